%% Worker processes as a security boundary (isolation => process, the pool
%% option `sandbox'; c_src/pool/sandbox.h): what a plugin that tries to get
%% out of its worker process can and cannot do, through the real pool node.
%% The plugin, plugin_escape.so, takes commands as binaries (its header
%% lists them); test_bin sandbox_wrap runs a pool node of its own with
%% Landlock hidden, as a kernel without it would, or as another user.
%%
%% CI runs as root: the pool node's workers then drop to uid 65534. The
%% non-root cases run a pool node as uid 65534 itself.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the pool nodes' I/O backend.
-module(actor_pool_sandbox_tests).

-import(ap_support, [wait_until/2, epmd_names/0]).
-import(ap_test_util, [with_pool/4]).

-include_lib("eunit/include/eunit.hrl").


-define(ASK_MS, 20000).
-define(WAIT_MS, 20000).

-export([a_plugin_reads_nothing_of_the_pool_node_the_beam_or_the_host/0,
         a_plugin_starts_with_no_environment_fds_or_privileges/0,
         the_pool_names_the_paths_a_plugin_may_touch/0,
         network_is_refused_unless_the_pool_allows_it/0,
         a_plugin_cannot_fork_or_exec_by_default/0,
         children_die_with_their_worker_at_stop/0,
         children_die_with_their_worker_on_a_timeout/0,
         children_die_with_their_worker_on_a_crash/0,
         children_share_their_workers_memory_limit/0,
         sandbox_options_are_checked/0,
         sandbox_off_is_what_it_says/0,
         a_layer_the_kernel_lacks_is_reported_and_warned_once/0,
         a_non_root_pool_node_keeps_its_memory_and_fds_from_its_plugin/0]).

actor_pool_sandbox_test_() ->
    {setup, fun ap_test_util:start_app/0, fun ap_test_util:stop_app/1,
     [{atom_to_list(F), {timeout, 120, fun ?MODULE:F/0}}
      || F <- [a_plugin_reads_nothing_of_the_pool_node_the_beam_or_the_host,
               a_plugin_starts_with_no_environment_fds_or_privileges,
               the_pool_names_the_paths_a_plugin_may_touch,
               network_is_refused_unless_the_pool_allows_it,
               a_plugin_cannot_fork_or_exec_by_default,
               children_die_with_their_worker_at_stop,
               children_die_with_their_worker_on_a_timeout,
               children_die_with_their_worker_on_a_crash,
               children_share_their_workers_memory_limit,
               sandbox_options_are_checked,
               sandbox_off_is_what_it_says,
               a_layer_the_kernel_lacks_is_reported_and_warned_once,
               a_non_root_pool_node_keeps_its_memory_and_fds_from_its_plugin]]}.

escape() ->
    {plugin, ap_support:test_bin("plugin_escape.so")}.

ask(P, Cmd) ->
    {ok, R} = actor_pool:ask(P, iolist_to_binary(Cmd), ?ASK_MS),
    R.

pool_node_os_pid() ->
    #{os_pid := OsPid} = actor_cnode:info(whereis(actor_pool_node_owner)),
    integer_to_list(OsPid).

root() ->
    string:trim(os:cmd("id -u")) =:= "0".

%% A file anybody may read, in a directory anybody may enter: only a
%% sandbox keeps a plugin from it.
with_public_file(Fun) ->
    Dir = ap_test_util:temp_dir("ap_sandbox"),
    ok = file:change_mode(Dir, 8#755),
    File = filename:join(Dir, "secret"),
    ok = file:write_file(File, <<"the host's own">>),
    ok = file:change_mode(File, 8#644),
    try
        Fun(Dir, File)
    after
        os:cmd("rm -rf '" ++ Dir ++ "'")
    end.

%% The audit's reads: the pool node's memory (the cookie) and fds (every
%% data-plane segment), the BEAM's memory, a file of the host's, the
%% shared-memory directory, a ptrace or a signal to either. Before the
%% sandbox each of these went through.
a_plugin_reads_nothing_of_the_pool_node_the_beam_or_the_host() ->
    Node = pool_node_os_pid(),
    Beam = os:getpid(),
    with_public_file(
      fun(_Dir, File) ->
              with_pool(?FUNCTION_NAME, escape(), #{workers => 1},
                        fun(P) ->
                                [?assertMatch({error, _}, ask(P, ["open r /proc/", Pid, "/", What]))
                                 || Pid <- [Node, Beam], What <- ["mem", "environ", "maps"]],
                                ?assertMatch({error, _}, ask(P, ["fdopen ", Node])),
                                ?assertMatch({error, _}, ask(P, ["fdopen ", Beam])),
                                ?assertMatch({error, _}, ask(P, ["read ", File])),
                                ?assertMatch({error, _}, ask(P, "open r /dev/shm")),
                                ?assertMatch({error, _}, ask(P, ["open w ", File])),
                                [?assertEqual({error, eperm}, ask(P, [Verb, " ", Pid]))
                                 || Verb <- ["ptrace", "vmread", "kill"], Pid <- [Node, Beam]],
                                %% What every plugin may read stays readable.
                                ?assertMatch({ok, <<_, _/binary>>}, ask(P, "read /proc/self/status")),
                                ?assertMatch({ok, _}, ask(P, "read /etc/ld.so.cache")),
                                #{sandbox := Sb} = actor_pool:stats(P),
                                ?assertMatch(#{missing := [], memory := infinity, fork := false,
                                               network := false}, Sb),
                                [?assert(lists:member(L, maps:get(layers, Sb)))
                                 || L <- [nodump, exec, no_new_privs, landlock, seccomp]],
                                ?assert(maps:get(landlock_abi, Sb) >= 1)
                        end)
      end).

%% Nothing of the pool node's but the channel: no variables, no fds but
%% 0-2, and, as root, another uid; no_new_privs and a seccomp filter.
a_plugin_starts_with_no_environment_fds_or_privileges() ->
    with_pool(?FUNCTION_NAME, escape(), #{workers => 1},
              fun(P) ->
                      %% A sanitizer build passes its options on, and
                      %% only them.
                      ?assertEqual([], [E || E <- ask(P, "env"),
                                             re:run(E, "^[A-Z]+SAN_OPTIONS=", [{capture, none}]) =/= match]),
                      ?assertEqual([0, 1, 2], lists:sort(ask(P, "fds"))),
                      {Uid, Gid, 1, 2} = ask(P, "ids"),
                      #{sandbox := Sb} = actor_pool:stats(P),
                      case root() of
                          true ->
                              ?assertEqual({65534, 65534}, {Uid, Gid}),
                              ?assertMatch(#{uid := 65534}, Sb),
                              ?assert(lists:member(uid, maps:get(layers, Sb)));
                          false ->
                              ?assertMatch(#{uid := inherited}, Sb)
                      end
              end).

%% read => [Dir]: read-only; write => [Dir]: read-write; the rest of the
%% host stays out of reach.
the_pool_names_the_paths_a_plugin_may_touch() ->
    with_public_file(
      fun(Ro, File) ->
              Rw = ap_test_util:temp_dir("ap_sandbox_rw"),
              ok = file:change_mode(Rw, 8#777),
              try
                  Opts = #{workers => 1, sandbox => #{read => [Ro], write => [list_to_binary(Rw)]}},
                  with_pool(?FUNCTION_NAME, escape(), Opts,
                            fun(P) ->
                                    ?assertEqual({ok, <<"the host's own">>}, ask(P, ["read ", File])),
                                    ?assertMatch({error, _}, ask(P, ["open w ", File])),
                                    ?assertMatch({error, _}, ask(P, ["open w ", Ro, "/new"])),
                                    New = filename:join(Rw, "made"),
                                    ?assertEqual(ok, ask(P, ["open w ", New])),
                                    ?assert(filelib:is_regular(New)),
                                    ?assertMatch(#{sandbox := #{paths := {[_], [_]}}}, actor_pool:stats(P))
                            end)
              after
                  os:cmd("rm -rf '" ++ Rw ++ "'")
              end
      end).

%% No sockets by default (epmd listens on 4369 here); network => true
%% gives TCP, and abstract Unix sockets stay scoped to the worker.
network_is_refused_unless_the_pool_allows_it() ->
    with_pool(?FUNCTION_NAME, escape(), #{workers => 1},
              fun(P) ->
                      ?assertEqual({error, eacces}, ask(P, "connect 4369")),
                      ?assertEqual({error, eacces}, ask(P, "abstract ap_sandbox_test"))
              end),
    Name = "ap_sandbox_" ++ integer_to_list(erlang:unique_integer([positive])),
    {ok, L} = gen_tcp:listen(0, [{ifaddr, {local, <<0, (list_to_binary(Name))/binary>>}}]),
    try
        with_pool(net_allowed, escape(), #{workers => 1, sandbox => #{network => true}},
                  fun(P) ->
                          ?assertEqual(ok, ask(P, "connect 4369")),
                          ?assertMatch({error, _}, ask(P, ["abstract ", Name])),
                          ?assertMatch(#{sandbox := #{network := true}}, actor_pool:stats(P))
                  end)
    after
        gen_tcp:close(L)
    end.

a_plugin_cannot_fork_or_exec_by_default() ->
    with_pool(?FUNCTION_NAME, escape(), #{workers => 1, max_memory_mb => 64},
              fun(P) ->
                      ?assertEqual({error, eperm}, ask(P, "fork 5 60")),
                      ?assertEqual({error, eperm}, ask(P, "exec")),
                      ?assertEqual({error, enosys}, ask(P, "uring")),
                      ?assertEqual(0, kids())
              end).

%% ===================================================================
%% fork => true: descendants are part of the worker
%% ===================================================================

%% Processes of plugin_escape's children alive on this host, busy or done
%% with their memory (a zombie is dead: the plugin does not reap them).
kids() ->
    length(kid_pids()).

%% Those of another pool node (a suite run beside this one on the host) are
%% not ours; one that left our pool node (reparented to init) still is.
kid_pids() ->
    Ours = pool_node_os_pid(),
    [Pid || Pid <- filelib:wildcard("/proc/[0-9]*"),
            case file:read_file(Pid ++ "/stat") of
                {ok, Stat} -> re:run(Stat, "^[0-9]+ \\(ap_escape_[a-z]+\\) [^Z]", [{capture, none}]) =:= match;
                _ -> false
            end,
            not under_another_pool_node(Pid, Ours)].

under_another_pool_node(ProcDir, Ours) ->
    case file:read_file(ProcDir ++ "/status") of
        {ok, S} ->
            case re:run(S, "PPid:\\s+([0-9]+)", [{capture, all_but_first, list}]) of
                {match, [P]} when P =:= "0"; P =:= "1"; P =:= Ours -> false;
                {match, [P]} ->
                    comm("/proc/" ++ P) =:= <<"actor_pool_node">>
                        orelse under_another_pool_node("/proc/" ++ P, Ours);
                nomatch -> false
            end;
        _ -> false
    end.

no_kids_left() ->
    ok = wait_until(fun() -> kids() =:= 0 end, ?WAIT_MS).

children_die_with_their_worker_at_stop() ->
    {ok, P} = actor_pool:start_pool(?FUNCTION_NAME, escape(), #{workers => 1, sandbox => #{fork => true}}),
    try
        ?assertEqual({forked, 5}, ask(P, "fork 5 0")),
        %% Each names itself once it runs.
        ok = wait_until(fun() -> kids() =:= 5 end, ?WAIT_MS),
        ?assert(lists:member(pidns, maps:get(layers, maps:get(sandbox, actor_pool:stats(P)))))
    after
        ok = actor_pool:stop_pool(P)
    end,
    no_kids_left().

children_die_with_their_worker_on_a_timeout() ->
    with_pool(?FUNCTION_NAME, escape(), #{workers => 1, handler_timeout_ms => 500, sandbox => #{fork => true}},
              fun(P) ->
                      ?assertEqual({error, handler_timeout}, actor_pool:ask(P, <<"forkhang 3">>, ?ASK_MS)),
                      no_kids_left(),
                      ?assertMatch(#{crash_causes := #{timeout := 1}}, actor_pool:stats(P))
              end).

children_die_with_their_worker_on_a_crash() ->
    with_pool(?FUNCTION_NAME, escape(), #{workers => 1, sandbox => #{fork => true}},
              fun(P) ->
                      ?assertEqual({error, {worker_crashed, sigabrt}},
                                   actor_pool:ask(P, <<"forkcrash 3">>, ?ASK_MS)),
                      no_kids_left(),
                      %% Its replacement serves.
                      ?assertMatch({_, _, 1, 2}, ask(P, "ids"))
              end).

%% The audit: five children held 311 MB against max_memory_mb => 64. Each
%% touches 60 MiB now in one cgroup of 64: at most one gets all of it,
%% the kernel kills the others.
children_share_their_workers_memory_limit() ->
    with_pool(?FUNCTION_NAME, escape(), #{workers => 1, max_memory_mb => 64, sandbox => #{fork => true}},
              fun(P) ->
                      #{sandbox := Sb} = actor_pool:stats(P),
                      ?assertMatch(#{memory := cgroup}, Sb),
                      ?assertEqual({forked, 5}, ask(P, "fork 5 60")),
                      %% Each child is done (renamed ap_escape_full) or dead.
                      ok = wait_until(fun() -> not lists:any(fun(K) -> comm(K) =:= <<"ap_escape_kid">> end,
                                                             kid_pids())
                                      end, ?WAIT_MS),
                      Full = [K || K <- kid_pids(), comm(K) =:= <<"ap_escape_full">>],
                      ?assert(length(Full) =< 1),
                      ?assert(lists:sum([pss_anon_kb(K) || K <- kid_pids()]) =< 64 * 1024)
              end),
    no_kids_left().

comm(ProcDir) ->
    case file:read_file(ProcDir ++ "/comm") of
        {ok, C} -> string:trim(C);
        _ -> gone
    end.

%% Proportional: pages a child still shares with its worker (copy on
%% write) count once over all of them, as the cgroup charges them; RssAnon
%% counted them in every child (an ASan worker's 3 MB of them put one child
%% holding its 60 MiB past 64 MiB).
pss_anon_kb(ProcDir) ->
    case file:read_file(ProcDir ++ "/smaps_rollup") of
        {ok, S} ->
            case re:run(S, "Pss_Anon:\\s+([0-9]+) kB", [{capture, all_but_first, list}]) of
                {match, [Kb]} -> list_to_integer(Kb);
                nomatch -> 0
            end;
        _ ->
            0
    end.

%% ===================================================================
%% Options
%% ===================================================================

sandbox_options_are_checked() ->
    Bad = [#{sandbox => on}, #{sandbox => #{read => ["relative"]}}, #{sandbox => #{write => "/tmp"}},
           #{sandbox => #{fork => yes}}, #{sandbox => #{uid => 0}}, #{sandbox => #{paths => []}},
           #{sandbox => #{read => [<<"/a", 0, "b">>]}},
           #{sandbox => #{read => [[$/ | integer_to_list(I)] || I <- lists:seq(1, 33)]}}],
    [?assertEqual({error, {badarg, {sandbox, maps:get(sandbox, O)}}},
                  actor_pool:start_pool(?FUNCTION_NAME, escape(), O)) || O <- Bad],
    %% A thread runs in the pool node: nothing to sandbox.
    ?assertEqual({error, {badarg, {sandbox, off}}},
                 actor_pool:start_pool(?FUNCTION_NAME, echo, #{sandbox => off})),
    ?assertMatch(#{sandbox := off}, stats_of(echo, #{})),
    %% The pool node checks too (any peer may ask it).
    Pn = actor_pool:pool_node(),
    ?assertMatch({error, {badarg, {sandbox, _}}},
                 gen_server:call({actor_pool_node, Pn},
                                 {start_pool, ?FUNCTION_NAME, escape_bin(), #{isolation => process,
                                                                              sandbox => #{read => [<<"x">>]}}})),
    %% A path the host lacks: the worker says so, and nothing starts.
    ?assertEqual({error, {sandbox_failed, landlock, <<"/nonexistent/ap: No such file or directory">>}},
                 actor_pool:start_pool(?FUNCTION_NAME, escape(), #{sandbox => #{read => ["/nonexistent/ap"]}})),
    ?assertEqual(undefined, whereis_pool(?FUNCTION_NAME)).

escape_bin() ->
    {plugin, P} = escape(),
    {plugin, list_to_binary(P)}.

whereis_pool(Name) ->
    proplists:get_value(Name, actor_pool:which_pools()).

stats_of(Handler, Opts) ->
    with_pool(stats_of, Handler, Opts, fun actor_pool:stats/1).

%% sandbox => off: the worker process of before (a crash boundary only),
%% said in stats/1.
sandbox_off_is_what_it_says() ->
    with_pool(?FUNCTION_NAME, escape(), #{workers => 1, sandbox => off},
              fun(P) ->
                      ?assertMatch(#{sandbox := off}, actor_pool:stats(P)),
                      ?assertNotEqual([], ask(P, "env")),
                      ?assertMatch({_, _, 0, 0}, ask(P, "ids"))
              end).

%% ===================================================================
%% Hosts with less: a kernel without Landlock, a pool node without root
%% ===================================================================

%% A pool node of its own through sandbox_wrap (Flags), its pools started
%% with node => it.
with_wrapped_node(Tag, Flags, Fun) ->
    Dir = ap_test_util:temp_dir("ap_sandbox_wrap"),
    ok = file:change_mode(Dir, 8#755),
    Script = filename:join(Dir, "pool_node"),
    Exe = ap_test_util:abs_exe(os:getenv("ACTOR_POOL_NODE_EXE", "actor_pool_node")),
    ok = file:write_file(Script, ["#!/bin/sh\nexec '", ap_support:test_bin("sandbox_wrap"), "' ", Flags,
                                  " '", Exe, "' \"$@\"\n"]),
    ok = file:change_mode(Script, 8#755),
    Alive = ap_test_util:alive(Tag),
    {ok, Owner} = actor_cnode:start(#{exe => Script, name => Alive}),
    try
        Fun(actor_cnode:node(Owner), actor_cnode:info(Owner))
    after
        ok = actor_cnode:stop(Owner),
        wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS),
        os:cmd("rm -rf '" ++ Dir ++ "'")
    end.

a_layer_the_kernel_lacks_is_reported_and_warned_once() ->
    with_wrapped_node(
      "sbnoll", "--no-landlock",
      fun(N, _Info) ->
              ok = ap_test_util:add_cnode_log_handler(?MODULE, N),
              try
                  {ok, _} = actor_pool:start_pool(nolandlock, escape(),
                                                  #{node => N, workers => 2, fast_path => false}),
                  P = {nolandlock, N},
                  #{sandbox := Sb} = actor_pool:stats(P),
                  ?assertEqual([landlock], maps:get(missing, Sb)),
                  ?assertNot(lists:member(landlock, maps:get(layers, Sb))),
                  ?assertEqual(0, maps:get(landlock_abi, Sb)),
                  %% What holds still holds: seccomp, and the uid as root.
                  ?assertEqual({error, eperm}, ask(P, ["ptrace ", os:getpid()])),
                  ok = actor_pool:stop_pool(P),
                  Warnings = [E || E <- flush_logs(N), string:find(text(E), "lacks: landlock") =/= nomatch],
                  ?assertEqual(1, length(Warnings))
              after
                  logger:remove_handler(?MODULE)
              end
      end).

%% The audit, as a non-root user: the worker runs with the pool node's uid,
%% so the pool node must not be dumpable: its memory (the cookie) and fds
%% are then root's to open. With Landlock hidden too, that alone holds.
a_non_root_pool_node_keeps_its_memory_and_fds_from_its_plugin() ->
    case root() of
        true -> ok;
        false -> error(needs_root_to_switch_to_uid_65534)
    end,
    [with_wrapped_node(
       Tag, ["--uid 65534 ", Flags],
       fun(N, #{os_pid := OsPid}) ->
               {ok, _} = actor_pool:start_pool(nonroot, escape(), #{node => N, workers => 1, fast_path => false}),
               P = {nonroot, N},
               Node = integer_to_list(OsPid),
               ?assertMatch({65534, 65534, 1, 2}, ask(P, "ids")),
               [?assertMatch({error, _}, ask(P, ["open r /proc/", Node, "/", What]))
                || What <- ["mem", "environ"]],
               ?assertMatch({error, _}, ask(P, ["fdopen ", Node])),
               ?assertEqual({error, eperm}, ask(P, ["ptrace ", Node])),
               #{sandbox := #{uid := inherited, layers := Layers}} = actor_pool:stats(P),
               ?assert(lists:member(nodump, Layers)),
               ok = actor_pool:stop_pool(P)
       end) || {Tag, Flags} <- [{"sbnonroot", ""}, {"sbnonrootnoll", "--no-landlock"}]],
    ok.

%% ===================================================================
%% C-node log events (ap_test_util:add_cnode_log_handler/2)
%% ===================================================================

flush_logs(N) ->
    receive
        {cnode_log, N, E} -> [E | flush_logs(N)]
    after 0 ->
        []
    end.

text(#{msg := {string, S}}) -> unicode:characters_to_list(S);
text(#{msg := {Format, Args}}) when is_list(Args) -> lists:flatten(io_lib:format(Format, Args));
text(_) -> "".
