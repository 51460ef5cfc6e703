%% Pools in the caller's supervision tree (`actor_pool:child_spec/3',
%% `actor_pool:start_link/3'), against the real application and its pool C
%% node: a pool under a supervisor goes with its child (terminate, shutdown
%% of the tree, a kill of the owner, a parent that exits, a supervisor that
%% gives up) and comes back with it, never `{error, already_started}'; a
%% restart of the pool node brings the pool back under the same owner; an
%% owner killed while its pool starts leaves no pool; the application's
%% stop takes the owner down. Every case polls with a deadline, never
%% sleeps, and stops what it started.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the pool node's I/O backend.
-module(actor_pool_child_spec_tests).

-behaviour(supervisor).

-import(ap_support, [wait_until/2]).

-include_lib("eunit/include/eunit.hrl").

-export([init/1]).
-export([child_spec_describes_start_link/1,
         bad_arguments_are_badarg_and_start_nothing/1,
         pool_runs_under_a_supervisor_and_goes_with_it/1,
         terminate_child_stops_the_pool_and_restart_child_starts_a_new_one/1,
         a_restarted_tree_gets_working_pools_not_already_started/1,
         a_name_held_outside_the_tree_is_already_started/1,
         killed_owner_stops_its_pool/1,
         killed_owner_under_a_supervisor_gets_a_fresh_pool_each_time/1,
         a_supervisor_past_its_restart_intensity_leaves_no_pool/1,
         a_parent_that_exits_takes_its_pool/1,
         an_owner_stops_only_its_own_pool/1,
         owner_killed_while_its_pool_starts_leaves_no_pool/1,
         pool_node_restart_brings_the_pool_back_under_the_same_owner/1,
         application_stop_stops_the_owner/1]).

-define(WAIT_MS, 20000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_pool_child_spec_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 child_spec_describes_start_link,
                 bad_arguments_are_badarg_and_start_nothing,
                 pool_runs_under_a_supervisor_and_goes_with_it,
                 terminate_child_stops_the_pool_and_restart_child_starts_a_new_one,
                 a_restarted_tree_gets_working_pools_not_already_started,
                 a_name_held_outside_the_tree_is_already_started,
                 killed_owner_stops_its_pool,
                 killed_owner_under_a_supervisor_gets_a_fresh_pool_each_time,
                 a_supervisor_past_its_restart_intensity_leaves_no_pool,
                 a_parent_that_exits_takes_its_pool,
                 an_owner_stops_only_its_own_pool,
                 owner_killed_while_its_pool_starts_leaves_no_pool,
                 pool_node_restart_brings_the_pool_back_under_the_same_owner,
                 %% Last: it stops and starts the application.
                 application_stop_stops_the_owner]]
     end}.

case_(Name, Ctx) ->
    {atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}.

setup() -> ap_test_util:pool_setup().

cleanup(Ctx) -> ap_test_util:pool_cleanup(Ctx).

%% The supervisors of these cases: this module is their callback.
init({Flags, Children}) ->
    {ok, {Flags, Children}}.

%% A one_for_one supervisor of Children, not linked to the test process (a
%% supervisor that gives up must not take the test down); stop it with
%% stop_sup/1.
start_sup(Children) ->
    start_sup(#{strategy => one_for_one, intensity => 10, period => 60}, Children).

start_sup(Flags, Children) ->
    case supervisor:start_link(?MODULE, {Flags, Children}) of
        {ok, Sup} ->
            true = unlink(Sup),
            Sup;
        Other ->
            Other
    end.

%% Stops supervisor Sup as its own parent would (shutdown: each child is
%% terminated in turn) and waits until it is gone.
stop_sup(Sup) ->
    Mref = erlang:monitor(process, Sup),
    exit(Sup, shutdown),
    receive {'DOWN', Mref, process, Sup, _} -> ok
    after ?WAIT_MS -> error({supervisor_still_up, Sup})
    end.

owner(Sup, Name) ->
    {_, Owner, worker, [actor_pool_owner]} = lists:keyfind({actor_pool, Name}, 1,
                                                           supervisor:which_children(Sup)),
    Owner.

pool_pid(Name) ->
    case lists:keyfind(Name, 1, actor_pool:which_pools()) of
        {Name, Pid} -> Pid;
        false -> none
    end.

%% Gone from the pool node: stats by name answer noproc, which_pools does
%% not list it.
gone(Name) ->
    actor_pool:stats(Name) =:= {error, noproc} andalso pool_pid(Name) =:= none.

wait_gone(Name) ->
    wait_until(fun() -> gone(Name) end, ?WAIT_MS).

%% A process that traps exits and runs Fun() for the caller: {Pid, Result}
%% is sent back; it stays until told `stop' (links kept).
spawn_parent(Fun) ->
    Self = self(),
    spawn(fun() ->
                  process_flag(trap_exit, true),
                  Self ! {self(), Fun()},
                  receive stop -> ok end
          end).

parent_result(Parent) ->
    receive {Parent, R} -> R
    after ?WAIT_MS -> error({no_result_from, Parent})
    end.

%% ===================================================================
%% Cases
%% ===================================================================

child_spec_describes_start_link(_Ctx) ->
    Opts = #{workers => 1},
    Spec = actor_pool:child_spec(cs_spec, echo, Opts),
    ?assertEqual(#{id => {actor_pool, cs_spec},
                   start => {actor_pool, start_link, [cs_spec, echo, Opts]},
                   restart => permanent,
                   shutdown => 5000,
                   type => worker,
                   modules => [actor_pool_owner]}, Spec),
    ?assertEqual(ok, supervisor:check_childspecs([Spec])),
    %% Nothing is started by describing it.
    ?assert(gone(cs_spec)).

%% The checks of start_pool/3, answered as errors: the caller (this test
%% process, which does not trap exits) stays, and no process or pool is
%% left. The node must be this node's pool node.
bad_arguments_are_badarg_and_start_nothing(#{pool_node := PoolNode}) ->
    Before = actor_pool:which_pools(),
    {links, Links} = process_info(self(), links),
    Missing = {plugin, "/nonexistent/actor_pool_plugin.so"},
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Other = list_to_atom(ap_test_util:alive("cs_elsewhere") ++ "@" ++ Host),
    Bad = [{"cs_bad", echo, #{}, {name, "cs_bad"}},
           {cs_bad, echo, #{workers => 0}, {workers, 0}},
           {cs_bad, echo, #{nope => 1}, {nope, 1}},
           {cs_bad, echo, not_a_map, {opts, not_a_map}},
           {cs_bad, echo, #{node => Other}, {node, Other}}],
    [?assertEqual({Name, Opts, {error, {badarg, Why}}},
                  {Name, Opts, actor_pool:start_link(Name, Handler, Opts)})
     || {Name, Handler, Opts, Why} <- Bad],
    %% A plugin that is not there: the pool node's answer, as start_pool's.
    MissingPath = <<"/nonexistent/actor_pool_plugin.so">>,
    ?assertMatch({error, {plugin_load_failed, MissingPath, _}}, actor_pool:start_link(cs_bad, Missing, #{})),
    %% Under a supervisor, the same reason from start_child (which adds
    %% the child, as for any failed start).
    Sup = start_sup([]),
    try
        [?assertMatch({Why, {error, {{badarg, Why}, _}}},
                      {Why, supervisor:start_child(Sup, actor_pool:child_spec(Name, Handler, Opts))})
         || {Name, Handler, Opts, Why} <- Bad],
        ?assertMatch({error, {{plugin_load_failed, MissingPath, _}, _}},
                     supervisor:start_child(Sup, actor_pool:child_spec(cs_bad, Missing, #{}))),
        ?assertEqual([], supervisor:which_children(Sup))
    after
        stop_sup(Sup)
    end,
    %% This node's own pool node, named, is fine.
    {ok, Owner} = actor_pool:start_link(cs_bad, echo, #{workers => 1, node => PoolNode}),
    ?assertEqual({ok, <<"ok">>}, actor_pool:ask(cs_bad, <<"ok">>)),
    ok = proc_lib:stop(Owner),
    ?assert(gone(cs_bad)),
    ?assertEqual(Before, actor_pool:which_pools()),
    wait_until(fun() ->
                       {links, Now} = process_info(self(), links),
                       lists:sort(Now) =:= lists:sort(Links)
               end, ?WAIT_MS).

pool_runs_under_a_supervisor_and_goes_with_it(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Sup = start_sup([actor_pool:child_spec(Name, echo, #{workers => 2})]),
    Owner = owner(Sup, Name),
    ?assertEqual({ok, <<"hi">>}, actor_pool:ask(Name, <<"hi">>)),
    ?assertMatch(#{name := Name, size := 2}, actor_pool:stats(Name)),
    ?assert(is_pid(pool_pid(Name))),
    stop_sup(Sup),
    %% Stopped by the owner's terminate, before the supervisor returned.
    ?assert(gone(Name)),
    ?assertNot(is_process_alive(Owner)).

terminate_child_stops_the_pool_and_restart_child_starts_a_new_one(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Id = {actor_pool, Name},
    Sup = start_sup([actor_pool:child_spec(Name, echo, #{workers => 1})]),
    try
        Pool1 = pool_pid(Name),
        ?assertEqual({ok, <<"1">>}, actor_pool:ask(Name, <<"1">>)),
        ok = supervisor:terminate_child(Sup, Id),
        ?assert(gone(Name)),
        ?assertEqual({error, noproc}, actor_pool:ask(Name, <<"x">>)),
        {ok, Owner2} = supervisor:restart_child(Sup, Id),
        ?assertEqual(Owner2, owner(Sup, Name)),
        ?assertEqual({ok, <<"2">>}, actor_pool:ask(Name, <<"2">>)),
        Pool2 = pool_pid(Name),
        ?assert(is_pid(Pool2) andalso Pool2 =/= Pool1),
        %% Again, and deleted for good.
        ok = supervisor:terminate_child(Sup, Id),
        ?assert(gone(Name)),
        ok = supervisor:delete_child(Sup, Id)
    after
        stop_sup(Sup)
    end,
    ?assert(gone(Name)).

%% An application restart, as the issue met it: the same tree stopped and
%% started again. Each time the pools run (one registered under a key), and
%% the key lists exactly the new pool.
a_restarted_tree_gets_working_pools_not_already_started(_Ctx) ->
    Key = actor_receptionist:service_key(<<"cs.restarted">>),
    Children = [actor_pool:child_spec(cs_tree_a, echo, #{workers => 1}),
                actor_pool:child_spec(cs_tree_b, echo, #{workers => 1, service_key => Key})],
    [begin
         Sup = start_sup(Children),
         ?assert(is_pid(Sup)),
         try
             ?assertEqual({ok, Round}, actor_pool:ask(cs_tree_a, Round)),
             ?assertEqual({ok, Round}, actor_pool:ask(cs_tree_b, Round)),
             ?assertEqual([pool_pid(cs_tree_b)], actor_receptionist:lookup(Key)),
             ?assertEqual({ok, Round}, actor_pool:ask(Key, Round))
         after
             stop_sup(Sup)
         end,
         ?assert(gone(cs_tree_a)),
         ?assert(gone(cs_tree_b)),
         ?assertEqual([], actor_receptionist:lookup(Key))
     end || Round <- [<<"first">>, <<"second">>, <<"third">>]],
    ok.

%% A name that a pool outside the tree holds is a real conflict: the
%% child's start says so, and the other pool is untouched.
a_name_held_outside_the_tree_is_already_started(_Ctx) ->
    Name = ?FUNCTION_NAME,
    {ok, P} = actor_pool:start_pool(Name, echo, #{workers => 1}),
    try
        %% A supervisor that fails to start exits, and takes a caller that
        %% does not trap exits along: started from one that does.
        Flags = #{strategy => one_for_one, intensity => 1, period => 60},
        Parent = spawn_parent(fun() -> start_sup(Flags, [actor_pool:child_spec(Name, echo, #{})]) end),
        ?assertEqual({error, {shutdown, {failed_to_start_child, {actor_pool, Name}, already_started}}},
                     parent_result(Parent)),
        Parent ! stop,
        ?assertEqual(P, pool_pid(Name)),
        ?assertEqual({ok, <<"mine">>}, actor_pool:ask(Name, <<"mine">>))
    after
        ok = actor_pool:stop_pool(P)
    end.

%% kill: the owner has no chance to stop its pool; the application does.
killed_owner_stops_its_pool(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Parent = spawn_parent(fun() -> actor_pool:start_link(Name, echo, #{workers => 1}) end),
    {ok, Owner} = parent_result(Parent),
    ?assertEqual({ok, <<"up">>}, actor_pool:ask(Name, <<"up">>)),
    exit(Owner, kill),
    wait_gone(Name),
    %% The name is free again.
    {ok, P} = actor_pool:start_pool(Name, echo, #{workers => 1}),
    ok = actor_pool:stop_pool(P),
    Parent ! stop.

%% The supervisor starts a new owner at once, while the old pool may still
%% be there (its owner's 'DOWN' not yet handled): each time the new owner
%% gets a new pool of the same name.
killed_owner_under_a_supervisor_gets_a_fresh_pool_each_time(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Sup = start_sup([actor_pool:child_spec(Name, echo, #{workers => 1})]),
    try
        lists:foldl(
          fun(I, {Owner, Pool}) ->
                  exit(Owner, kill),
                  wait_until(fun() -> New0 = owner(Sup, Name), is_pid(New0) andalso New0 =/= Owner end,
                             ?WAIT_MS),
                  New = owner(Sup, Name),
                  Msg = integer_to_binary(I),
                  ?assertEqual({ok, Msg}, actor_pool:ask(Name, Msg)),
                  NewPool = pool_pid(Name),
                  ?assert(is_pid(NewPool) andalso NewPool =/= Pool),
                  {New, NewPool}
          end, {owner(Sup, Name), pool_pid(Name)}, lists:seq(1, 5))
    after
        stop_sup(Sup)
    end,
    ?assert(gone(Name)).

%% Restart intensity 2: the third kill makes the supervisor give up (it
%% exits `shutdown'); nothing of its pools is left, the untouched sibling's
%% included.
a_supervisor_past_its_restart_intensity_leaves_no_pool(_Ctx) ->
    Flags = #{strategy => one_for_one, intensity => 2, period => 3600},
    Sup = start_sup(Flags, [actor_pool:child_spec(cs_intensity_a, echo, #{workers => 1}),
                            actor_pool:child_spec(cs_intensity_b, echo, #{workers => 1})]),
    Mref = erlang:monitor(process, Sup),
    Kill = fun() ->
                   Owner = owner(Sup, cs_intensity_a),
                   exit(Owner, kill),
                   Owner
           end,
    [begin
         Old = Kill(),
         wait_until(fun() -> New = owner(Sup, cs_intensity_a), is_pid(New) andalso New =/= Old end,
                    ?WAIT_MS),
         ?assertEqual({ok, <<"again">>}, actor_pool:ask(cs_intensity_a, <<"again">>))
     end || _ <- [1, 2]],
    _ = Kill(),
    receive
        {'DOWN', Mref, process, Sup, Why} -> ?assertEqual(shutdown, Why)
    after ?WAIT_MS -> error(supervisor_did_not_give_up)
    end,
    ?assert(gone(cs_intensity_b)),
    wait_gone(cs_intensity_a).

%% start_link from a plain process: its normal exit stops the owner and the
%% pool.
a_parent_that_exits_takes_its_pool(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Self = self(),
    Parent = spawn(fun() ->
                           Self ! {self(), actor_pool:start_link(Name, echo, #{workers => 1})},
                           receive stop -> ok end
                   end),
    {ok, Owner} = parent_result(Parent),
    ?assertEqual({ok, <<"up">>}, actor_pool:ask(Name, <<"up">>)),
    Mref = erlang:monitor(process, Owner),
    Parent ! stop,
    receive {'DOWN', Mref, process, Owner, Why} -> ?assertEqual(normal, Why)
    after ?WAIT_MS -> error(owner_outlived_its_parent)
    end,
    %% The owner stopped its pool before it exited.
    ?assert(gone(Name)).

%% stop_pool/1 on an owned pool ends the ownership: a pool started later
%% under the same name by someone else is not the owner's to stop, whether
%% the owner terminates or is killed.
an_owner_stops_only_its_own_pool(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Sup = start_sup([actor_pool:child_spec(Name, echo, #{workers => 1})]),
    try
        ok = actor_pool:stop_pool(Name),
        ?assert(gone(Name)),
        {ok, P} = actor_pool:start_pool(Name, echo, #{workers => 1}),
        Owner = owner(Sup, Name),
        ok = supervisor:terminate_child(Sup, {actor_pool, Name}),
        ?assertNot(is_process_alive(Owner)),
        ?assertEqual(P, pool_pid(Name)),
        ?assertEqual({ok, <<"still">>}, actor_pool:ask(Name, <<"still">>)),
        ok = actor_pool:stop_pool(P)
    after
        stop_sup(Sup)
    end,
    Parent = spawn_parent(fun() -> actor_pool:start_link(Name, echo, #{workers => 1}) end),
    {ok, Owner2} = parent_result(Parent),
    ok = actor_pool:stop_pool(Name),
    {ok, P2} = actor_pool:start_pool(Name, echo, #{workers => 1}),
    Keeper = whereis(actor_pool_keeper),
    exit(Owner2, kill),
    %% A barrier, not an assertion: the keeper's monitor of the owner has
    %% fired (its 'DOWN' is in the keeper's queue), and a call made after
    %% that is answered after the 'DOWN' was handled.
    wait_until(fun() ->
                       {monitors, Ms} = process_info(Keeper, monitors),
                       not lists:member({process, Owner2}, Ms)
               end, ?WAIT_MS),
    _ = sys:get_state(Keeper),
    ?assertEqual(P2, pool_pid(Name)),
    ?assertEqual({ok, <<"still">>}, actor_pool:ask(Name, <<"still">>)),
    ok = actor_pool:stop_pool(P2),
    Parent ! stop.

%% Killed while the pool's workers run their init (3 s: time to kill it
%% in, on a loaded machine too): the start goes on,
%% and the pool is stopped as soon as it runs; the name is free after.
owner_killed_while_its_pool_starts_leaves_no_pool(_Ctx) ->
    Name = ?FUNCTION_NAME,
    {plugin, Path} = ap_test_util:crash_plugin(),
    Slow = {plugin, Path, {init_sleep, 3000}},
    Parent = spawn_parent(fun() ->
                                  actor_pool:start_link(Name, Slow, #{workers => 1, isolation => thread})
                          end),
    %% Known by name from the start request on, its worker starting.
    wait_until(fun() -> is_map(catch actor_pool:stats(Name)) end, ?WAIT_MS),
    {links, [Owner]} = process_info(Parent, links),
    exit(Owner, kill),
    ?assertEqual({error, killed}, parent_result(Parent)),
    wait_gone(Name),
    {ok, P} = actor_pool:start_pool(Name, echo, #{workers => 1}),
    ok = actor_pool:stop_pool(P),
    Parent ! stop.

%% kill -9 of the pool node: the keeper starts the pool again (a new pid),
%% the owner stays up and is still its owner: terminating it stops the new
%% pool.
pool_node_restart_brings_the_pool_back_under_the_same_owner(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Key = actor_receptionist:service_key(<<"cs.node_restart">>),
    Sup = start_sup([actor_pool:child_spec(Name, echo, #{workers => 1, service_key => Key})]),
    try
        Owner = owner(Sup, Name),
        Pool1 = pool_pid(Name),
        OsPid = node_os_pid(),
        _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        wait_until(fun() ->
                           case actor_cnode:info(actor_pool_node_owner) of
                               #{status := up, os_pid := New} -> New =/= OsPid;
                               _ -> false
                           end
                   end, ?WAIT_MS),
        wait_until(fun() -> is_pid(pool_pid(Name)) end, ?WAIT_MS),
        Pool2 = pool_pid(Name),
        ?assertNotEqual(Pool1, Pool2),
        ?assertEqual({ok, <<"back">>}, actor_pool:ask(Name, <<"back">>)),
        wait_until(fun() -> actor_receptionist:lookup(Key) =:= [Pool2] end, ?WAIT_MS),
        ?assertEqual(Owner, owner(Sup, Name)),
        ?assert(is_process_alive(Owner)),
        ok = supervisor:terminate_child(Sup, {actor_pool, Name}),
        ?assert(gone(Name)),
        ?assertEqual([], actor_receptionist:lookup(Key))
    after
        stop_sup(Sup)
    end.

%% The pool is gone with the application's pool node; its owner says so
%% and exits, and starts again once the application runs.
application_stop_stops_the_owner(_Ctx) ->
    Name = ?FUNCTION_NAME,
    Parent = spawn_parent(fun() -> actor_pool:start_link(Name, echo, #{workers => 1}) end),
    {ok, Owner} = parent_result(Parent),
    Mref = erlang:monitor(process, Owner),
    ok = application:stop(actor_pool),
    receive {'DOWN', Mref, process, Owner, Why} ->
            ?assertMatch({shutdown, {actor_pool_down, _}}, Why)
    after ?WAIT_MS -> error(owner_outlived_the_application)
    end,
    %% Not running: no pool can be owned.
    ?assertEqual({error, noproc}, actor_pool:start_link(Name, echo, #{})),
    {ok, _} = application:ensure_all_started(actor_pool),
    {ok, Owner2} = actor_pool:start_link(Name, echo, #{workers => 1}),
    ?assertEqual({ok, <<"again">>}, actor_pool:ask(Name, <<"again">>)),
    ok = proc_lib:stop(Owner2),
    ?assert(gone(Name)),
    Parent ! stop.

node_os_pid() ->
    #{os_pid := OsPid, status := up} = actor_cnode:info(actor_pool_node_owner),
    OsPid.
