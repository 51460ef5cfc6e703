%% Behaviour of the receptionist (actor_receptionist) on one node, against
%% the real receptionist C node that the application starts
%% (priv/actor_receptionist_node) and the NIF that reads its snapshot.
%%
%% Every example and rule of the seed (docs/receptionist.md) is a case
%% here. Cases use keys named after themselves (registrations are not
%% watched, so they outlive their case), wait on messages, and use a
%% barrier instead of sleeping: a `find' from the test process is answered
%% after everything sent before it, so a listing that was going to arrive
%% has arrived by then.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the I/O backend; `make eunit' runs
%% this module once with each.
-module(actor_receptionist_tests).

-import(ap_test_util, [spawn_collector/0, collected/1]).
-import(ap_support, [wait_until/2, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").
-include("../include/actor_receptionist.hrl").
-include_lib("kernel/include/file.hrl").

-export([log/2]).
-export([register_then_find_sees_it/1,
         many_refs_per_key_in_registration_order/1,
         one_ref_per_key_by_convention/1,
         registering_twice_is_idempotent/1,
         deregister_with_reply/1,
         deregister_without_reply/1,
         subscribe_then_changes/1,
         no_listing_without_a_change/1,
         listings_for_one_subscriber_arrive_in_order/1,
         unsubscribe_stops_listings/1,
         per_key_limit_rejects_with_reason_and_limit/1,
         total_limit_rejects_with_reason_and_limit/1,
         subscriber_death_frees_its_slot/1,
         registrations_persist_after_the_process_dies/1,
         same_id_same_key/1,
         bad_keys_and_refs_are_badarg_and_change_nothing/1,
         lookup_reflects_every_acknowledged_registration/1,
         lookup_of_unknown_key_is_empty/1,
         lookup_falls_back_when_no_snapshot_is_mapped/1,
         single_node_mode_needs_no_cluster/1,
         bad_start_options_are_badarg/1,
         the_model_property_holds/1,
         a_watched_registration_goes_when_its_process_dies/1,
         register_options_are_checked_and_empty_is_register_3/1,
         deregister_ends_a_watch_and_the_first_watch_sticks/1,
         a_gen_server_is_named_through_the_receptionist/1,
         via_names_are_keys_and_one_member_gives_a_name_once/1,
         a_supervisor_restarts_a_named_child_under_its_name/1,
         a_dead_holder_frees_its_name_before_its_down_arrives/1,
         a_watch_survives_a_server_restart/1,
         receptionist_crash_is_replayed/1,
         requests_while_down_are_applied_once_back/1,
         server_crash_restarts_the_node_and_keeps_the_journal/1,
         lost_connection_restarts_the_node_and_keeps_the_journal/1,
         deeply_nested_message_does_not_crash_the_node/1,
         a_killed_c_node_leaves_no_segment/1,
         a_starting_node_sweeps_orphans_and_keeps_live_segments/1,
         a_second_node_never_takes_a_live_segment/1,
         a_fifo_under_the_segment_name_never_hangs_the_owner/1,
         an_immediate_restart_after_the_owner_dies_gets_a_live_snapshot/1]).

-define(WAIT_MS, 10000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_receptionist_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 register_then_find_sees_it,
                 many_refs_per_key_in_registration_order,
                 one_ref_per_key_by_convention,
                 registering_twice_is_idempotent,
                 deregister_with_reply,
                 deregister_without_reply,
                 subscribe_then_changes,
                 no_listing_without_a_change,
                 listings_for_one_subscriber_arrive_in_order,
                 unsubscribe_stops_listings,
                 per_key_limit_rejects_with_reason_and_limit,
                 total_limit_rejects_with_reason_and_limit,
                 subscriber_death_frees_its_slot,
                 registrations_persist_after_the_process_dies,
                 same_id_same_key,
                 bad_keys_and_refs_are_badarg_and_change_nothing,
                 lookup_reflects_every_acknowledged_registration,
                 lookup_of_unknown_key_is_empty,
                 lookup_falls_back_when_no_snapshot_is_mapped,
                 single_node_mode_needs_no_cluster,
                 bad_start_options_are_badarg,
                 the_model_property_holds,
                 %% opt-in beyond the seed: watched refs, via names
                 a_watched_registration_goes_when_its_process_dies,
                 register_options_are_checked_and_empty_is_register_3,
                 deregister_ends_a_watch_and_the_first_watch_sticks,
                 a_gen_server_is_named_through_the_receptionist,
                 via_names_are_keys_and_one_member_gives_a_name_once,
                 a_supervisor_restarts_a_named_child_under_its_name,
                 a_dead_holder_frees_its_name_before_its_down_arrives,
                 %% these kill or cut off the receptionist C node (or its server)
                 a_watch_survives_a_server_restart,
                 receptionist_crash_is_replayed,
                 requests_while_down_are_applied_once_back,
                 server_crash_restarts_the_node_and_keeps_the_journal,
                 lost_connection_restarts_the_node_and_keeps_the_journal,
                 deeply_nested_message_does_not_crash_the_node,
                 %% segments of C nodes that died
                 a_killed_c_node_leaves_no_segment,
                 a_starting_node_sweeps_orphans_and_keeps_live_segments,
                 a_second_node_never_takes_a_live_segment,
                 a_fifo_under_the_segment_name_never_hangs_the_owner,
                 an_immediate_restart_after_the_owner_dies_gets_a_live_snapshot]]
     end}.

case_(Name, Ctx) ->
    {atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}.

setup() ->
    WasAlive = ap_test_util:start_app(),
    Node = actor_receptionist:receptionist_node(),
    ?assert(is_atom(Node) andalso Node =/= undefined),
    #{rcpt_node => Node, was_alive => WasAlive}.

cleanup(#{was_alive := WasAlive, rcpt_node := Node}) ->
    Shm = "/dev/shm" ++ actor_receptionist_server:shm_name(Node),
    ap_test_util:stop_app(WasAlive),
    %% A clean stop unlinks the snapshot.
    ?assertEqual(false, filelib:is_file(Shm)).

%% ===================================================================
%% The seed's examples and rules
%% ===================================================================

register_then_find_sees_it(_Ctx) ->
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:register(K, self(), self()),
    ?assertEqual({registered, K, self()}, next()),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, [self()]}, next()),
    %% Without waiting for anything: a register then a find from one
    %% process always sees it.
    K2 = key(register_then_find_without_reply),
    ok = actor_receptionist:register(K2, self()),
    ok = actor_receptionist:find(K2, self()),
    ?assertEqual(#listing{key = K2, refs = [self()]}, next()).

many_refs_per_key_in_registration_order(_Ctx) ->
    K = key(?FUNCTION_NAME),
    Refs = [spawn_idle() || _ <- lists:seq(1, 20)],
    [ok = actor_receptionist:register(K, R) || R <- Refs],
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, Refs}, next()),
    ?assertEqual(Refs, actor_receptionist:lookup(K)),
    stop_all(Refs).

one_ref_per_key_by_convention(_Ctx) ->
    %% A singleton-like service: one ref; consumers take the first, with a
    %% fallback for the empty case. Nothing enforces a single instance.
    K = key(?FUNCTION_NAME),
    First = fun() -> case actor_receptionist:lookup(K) of
                         [Ref | _] -> Ref;
                         [] -> none
                     end
            end,
    ?assertEqual(none, First()),
    ok = actor_receptionist:register(K, self(), self()),
    {registered, K, _} = next(),
    ?assertEqual(self(), First()),
    Other = spawn_idle(),
    ok = actor_receptionist:register(K, Other, self()),
    {registered, K, _} = next(),
    ?assertEqual([self(), Other], actor_receptionist:lookup(K)),
    stop_all([Other]).

registering_twice_is_idempotent(_Ctx) ->
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:register(K, self(), self()),
    ok = actor_receptionist:register(K, self(), self()),
    %% Both are acknowledged; the ref is listed once.
    ?assertEqual({registered, K, self()}, next()),
    ?assertEqual({registered, K, self()}, next()),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, [self()]}, next()).

deregister_with_reply(_Ctx) ->
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:register(K, self(), self()),
    {registered, K, _} = next(),
    ok = actor_receptionist:deregister(K, self(), self()),
    ?assertEqual({deregistered, K, self()}, next()),
    ?assertEqual([], actor_receptionist:lookup(K)),
    %% Deregistering what is not there is acknowledged too.
    ok = actor_receptionist:deregister(K, self(), self()),
    ?assertEqual(#deregistered{key = K, ref = self()}, next()).

deregister_without_reply(_Ctx) ->
    K = key(?FUNCTION_NAME),
    Other = spawn_idle(),
    ok = actor_receptionist:register(K, self()),
    ok = actor_receptionist:register(K, Other),
    ok = actor_receptionist:deregister(K, self()),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, [Other]}, next()),
    stop_all([Other]).

subscribe_then_changes(_Ctx) ->
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:subscribe(K, self()),
    ?assertEqual({listing, K, []}, next()),
    A = spawn_idle(),
    B = spawn_idle(),
    ok = actor_receptionist:register(K, A),
    ?assertEqual({listing, K, [A]}, next()),
    ok = actor_receptionist:register(K, B),
    ?assertEqual({listing, K, [A, B]}, next()),
    ok = actor_receptionist:deregister(K, A),
    ?assertEqual({listing, K, [B]}, next()),
    ok = actor_receptionist:deregister(K, B),
    ?assertEqual({listing, K, []}, next()),
    ok = actor_receptionist:unsubscribe(K, self()),
    stop_all([A, B]).

no_listing_without_a_change(_Ctx) ->
    K = key(?FUNCTION_NAME),
    A = spawn_idle(),
    ok = actor_receptionist:register(K, A),
    ok = actor_receptionist:subscribe(K, self()),
    ?assertEqual({listing, K, [A]}, next()),
    ok = actor_receptionist:register(K, A),            %% already there
    ok = actor_receptionist:deregister(K, spawn_idle()), %% never there
    ok = actor_receptionist:register(key(other_key_of_no_listing), A),
    barrier(),
    ?assertEqual([], drain()),
    ok = actor_receptionist:unsubscribe(K, self()),
    stop_all([A]).

listings_for_one_subscriber_arrive_in_order(_Ctx) ->
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:subscribe(K, self()),
    {listing, K, []} = next(),
    Refs = [spawn_idle() || _ <- lists:seq(1, 50)],
    [ok = actor_receptionist:register(K, R) || R <- Refs],
    Got = [next() || _ <- Refs],
    Want = [{listing, K, lists:sublist(Refs, N)} || N <- lists:seq(1, 50)],
    ?assertEqual(Want, Got),
    ok = actor_receptionist:unsubscribe(K, self()),
    stop_all(Refs).

unsubscribe_stops_listings(_Ctx) ->
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:subscribe(K, self()),
    {listing, K, []} = next(),
    ok = actor_receptionist:unsubscribe(K, self()),
    ok = actor_receptionist:register(K, self()),
    barrier(),
    ?assertEqual([], drain()).

per_key_limit_rejects_with_reason_and_limit(_Ctx) ->
    with_env(#{max_subscribers_per_key => 2, max_subscribers_total => 100}, fun() ->
        K = key(?FUNCTION_NAME),
        [S1, S2, S3] = [spawn_collector() || _ <- [1, 2, 3]],
        [ok = actor_receptionist:subscribe(K, S) || S <- [S1, S2, S3]],
        ok = actor_receptionist:register(K, self()),
        barrier(),
        ?assertEqual([{listing, K, []}, {listing, K, [self()]}], collected(S1)),
        ?assertEqual([{listing, K, []}, {listing, K, [self()]}], collected(S2)),
        %% Rejected, and nothing after the rejection.
        ?assertEqual([#receptionist_subscribe_rejected{key = K, reason = max_subscribers_per_key,
                                                       limit = 2}], collected(S3)),
        %% Other keys still have room.
        ok = actor_receptionist:subscribe(key(per_key_limit_other), S3),
        barrier(),
        ?assertMatch([_, {listing, _, []}], collected(S3)),
        stop_all([S1, S2, S3])
    end).

total_limit_rejects_with_reason_and_limit(_Ctx) ->
    with_env(#{max_subscribers_per_key => 100, max_subscribers_total => 3}, fun() ->
        Keys = [key({?FUNCTION_NAME, I}) || I <- [1, 2, 3, 4]],
        S = spawn_collector(),
        [ok = actor_receptionist:subscribe(K, S) || K <- Keys],
        ok = actor_receptionist:register(lists:last(Keys), self()),
        barrier(),
        [K1, K2, K3, K4] = Keys,
        ?assertEqual([{listing, K1, []}, {listing, K2, []}, {listing, K3, []},
                      {receptionist_subscribe_rejected, K4, max_subscribers_total, 3}],
                     collected(S)),
        stop_all([S])
    end).

subscriber_death_frees_its_slot(_Ctx) ->
    with_env(#{max_subscribers_per_key => 1, max_subscribers_total => 100}, fun() ->
        K = key(?FUNCTION_NAME),
        S1 = spawn_collector(),
        ok = actor_receptionist:subscribe(K, S1),
        barrier(),
        ?assertEqual([{listing, K, []}], collected(S1)),
        Mref = monitor(process, S1),
        exit(S1, kill),
        receive {'DOWN', Mref, _, _, _} -> ok end,
        %% The server learns of the death by its own monitor; retry with a
        %% fresh subscriber until the slot is free.
        wait_until(fun() ->
                           S = spawn_collector(),
                           ok = actor_receptionist:subscribe(K, S),
                           barrier(),
                           case collected(S) of
                               [{listing, K, []}] -> true;
                               [{receptionist_subscribe_rejected, K, _, 1}] -> stop_all([S]), false
                           end
                   end, ?WAIT_MS),
        #{local_subscriptions := N} = actor_receptionist:stats(),
        ?assertEqual(1, N)
    end).

registrations_persist_after_the_process_dies(_Ctx) ->
    %% Refs are not watched: a dead ref stays until deregistered.
    K = key(?FUNCTION_NAME),
    P = spawn_idle(),
    ok = actor_receptionist:register(K, P, self()),
    {registered, K, P} = next(),
    stop_all([P]),
    ?assertNot(is_process_alive(P)),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, [P]}, next()),
    ?assertEqual([P], actor_receptionist:lookup(K)),
    ok = actor_receptionist:deregister(K, P, self()),
    {deregistered, K, P} = next().

same_id_same_key(_Ctx) ->
    Bin = <<"same_id_same_key">>,
    ?assertEqual({service_key, Bin}, actor_receptionist:service_key(Bin)),
    ?assertEqual(actor_receptionist:service_key(Bin), actor_receptionist:service_key(same_id_same_key)),
    ?assertEqual(actor_receptionist:service_key(Bin), actor_receptionist:service_key("same_id_same_key")),
    ?assertEqual(#service_key{id = Bin}, actor_receptionist:service_key(actor_receptionist:service_key(Bin))),
    %% Unicode ids normalise to UTF-8.
    ?assertEqual({service_key, <<"caf", 195, 169>>}, actor_receptionist:service_key([$c, $a, $f, 233])),
    ok = actor_receptionist:register(same_id_same_key, self()),
    ok = actor_receptionist:find("same_id_same_key", self()),
    ?assertEqual({listing, {service_key, Bin}, [self()]}, next()),
    ?assertEqual([self()], actor_receptionist:lookup(Bin)),
    ok = actor_receptionist:deregister({service_key, Bin}, self()).

bad_keys_and_refs_are_badarg_and_change_nothing(_Ctx) ->
    K = key(?FUNCTION_NAME),
    Long = binary:copy(<<"x">>, 1025),
    ?assertError(badarg, actor_receptionist:service_key(<<>>)),
    ?assertError(badarg, actor_receptionist:service_key(Long)),
    ?assertError(badarg, actor_receptionist:service_key(42)),
    ?assertError(badarg, actor_receptionist:service_key([-1])),
    ?assertEqual({error, {badarg, {key, 42}}}, actor_receptionist:register(42, self())),
    ?assertEqual({error, {badarg, {key, Long}}}, actor_receptionist:register(Long, self())),
    ?assertEqual({error, {badarg, {ref, not_a_pid}}}, actor_receptionist:register(K, not_a_pid)),
    ?assertEqual({error, {badarg, {reply_to, x}}}, actor_receptionist:register(K, self(), x)),
    ?assertEqual({error, {badarg, {ref, "p"}}}, actor_receptionist:deregister(K, "p")),
    ?assertEqual({error, {badarg, {reply_to, 1}}}, actor_receptionist:find(K, 1)),
    ?assertEqual({error, {badarg, {subscriber, x}}}, actor_receptionist:subscribe(K, x)),
    ?assertEqual({error, {badarg, {key, {service_key, 1}}}},
                 actor_receptionist:unsubscribe({service_key, 1}, self())),
    ?assertError(badarg, actor_receptionist:lookup(<<>>)),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, []}, next()).

lookup_reflects_every_acknowledged_registration(_Ctx) ->
    K = key(?FUNCTION_NAME),
    ?assertMatch(#{mapped := true}, actor_nif:info()),
    Refs = [spawn_idle() || _ <- lists:seq(1, 200)],
    lists:foldl(fun(R, Acc) ->
                        ok = actor_receptionist:register(K, R, self()),
                        {registered, K, R} = next(),
                        %% Straight from the snapshot: no message involved.
                        ?assertEqual(Acc ++ [R], actor_nif:lookup(element(2, K))),
                        Acc ++ [R]
                end, [], Refs),
    [begin
         ok = actor_receptionist:deregister(K, R, self()),
         {deregistered, K, R} = next(),
         ?assertNot(lists:member(R, actor_receptionist:lookup(K)))
     end || R <- Refs],
    ?assertEqual([], actor_receptionist:lookup(K)),
    stop_all(Refs).

lookup_of_unknown_key_is_empty(_Ctx) ->
    ?assertEqual([], actor_receptionist:lookup(key(?FUNCTION_NAME))),
    ?assertEqual([], actor_receptionist:lookup(binary:copy(<<"z">>, 1024))).

lookup_falls_back_when_no_snapshot_is_mapped(#{rcpt_node := Node}) ->
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:register(K, self(), self()),
    {registered, K, _} = next(),
    ok = actor_nif:detach(),
    try
        ?assertEqual({error, unmapped}, actor_nif:lookup(element(2, K))),
        %% Answered by the receptionist C node itself.
        ?assertEqual([self()], actor_receptionist:lookup(K))
    after
        Name = list_to_binary(actor_receptionist_server:shm_name(Node)),
        ok = actor_nif:attach(Name, atom_to_binary(Node, utf8))
    end,
    ?assertEqual([self()], actor_nif:lookup(element(2, K))).

single_node_mode_needs_no_cluster(#{rcpt_node := Node}) ->
    %% No other BEAM node: the receptionist serves the same API locally.
    ?assertEqual([], nodes()),
    ?assert(lists:member(Node, nodes(hidden))),
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:subscribe(K, self()),
    {listing, K, []} = next(),
    ok = actor_receptionist:register(K, self()),
    ?assertEqual({listing, K, [self()]}, next()),
    ok = actor_receptionist:unsubscribe(K, self()),
    #{keys := Keys, refs := RefCount, shm_state := live} = actor_receptionist:stats(),
    ?assert(Keys >= 1 andalso RefCount >= 1),
    %% The snapshot is named after the receptionist node, readable by this
    %% user only, and mapped by the NIF.
    Shm = "/dev/shm" ++ actor_receptionist_server:shm_name(Node),
    {ok, #file_info{mode = Mode, type = regular}} = file:read_file_info(Shm),
    ?assertEqual(8#600, Mode band 8#777),
    ?assertMatch(#{mapped := true, state := live}, actor_nif:info()),
    ?assertEqual(atom_to_binary(Node, utf8), maps:get(node, actor_nif:info())).

bad_start_options_are_badarg(_Ctx) ->
    ?assertEqual({error, {badarg, {max_subscribers_per_key, -1}}},
                 actor_receptionist_sup:start_link(#{max_subscribers_per_key => -1})),
    ?assertEqual({error, {badarg, {max_subscribers_total, x}}},
                 actor_receptionist_sup:start_link(#{max_subscribers_total => x})),
    ?assertEqual({error, {badarg, {shm_mb, 0}}}, actor_receptionist_sup:start_link(#{shm_mb => 0})),
    ?assertEqual({error, {badarg, {bogus, 1}}}, actor_receptionist_sup:start_link(#{bogus => 1})),
    ?assertEqual({error, {badarg, {opts, x}}}, actor_receptionist_sup:start_link(x)).

the_model_property_holds(_Ctx) ->
    ?assert(proper:quickcheck(actor_receptionist_prop:prop_matches_model(),
                              [{numtests, 60}, {to_file, user}, noshrink])).

%% ===================================================================
%% Beyond the seed (opt-in): watched registrations, via names
%% ===================================================================

a_watched_registration_goes_when_its_process_dies(_Ctx) ->
    K = key(?FUNCTION_NAME), Plain = key({?FUNCTION_NAME, plain}),
    W0 = watched(),
    S = spawn_collector(),
    ok = actor_receptionist:subscribe(K, S),
    P = spawn_idle(),
    ok = actor_receptionist:register(K, P, self(), #{watch => true}),
    ?assertEqual({registered, K, P}, next()),
    %% The same process under another key, not watched: the seed's rule.
    ok = actor_receptionist:register(Plain, P, self()),
    ?assertEqual({registered, Plain, P}, next()),
    ?assertEqual([P], actor_receptionist:lookup(K)),
    ?assertEqual(W0 + 1, watched()),
    stop_all([P]),
    %% Deregistered by the receptionist: a smaller listing, gone from
    %% lookup and find, and no longer watched.
    wait_until(fun() -> collected(S) =:= [{listing, K, []}, {listing, K, [P]}, {listing, K, []}] end,
               ?WAIT_MS),
    ?assertEqual([], actor_receptionist:lookup(K)),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, []}, next()),
    ?assertEqual(W0, watched()),
    %% The unwatched registration of the same dead process stays.
    ok = actor_receptionist:find(Plain, self()),
    ?assertEqual({listing, Plain, [P]}, next()),
    ok = actor_receptionist:deregister(Plain, P),
    stop_all([S]).

register_options_are_checked_and_empty_is_register_3(_Ctx) ->
    K = key(?FUNCTION_NAME),
    P = spawn_idle(), Q = spawn_idle(),
    [?assertEqual({error, {badarg, {opts, O}}}, actor_receptionist:register(K, P, self(), O))
     || O <- [#{watch => yes}, #{bogus => 1}, #{watch => true, bogus => 1}, [{watch, true}], watch]],
    ?assertEqual({error, {badarg, {reply_to, x}}}, actor_receptionist:register(K, P, x, #{})),
    ?assertEqual({error, {badarg, {key, 42}}},
                 actor_receptionist:register(42, P, self(), #{watch => true})),
    ?assertEqual({error, {badarg, {ref, x}}},
                 actor_receptionist:register(K, x, self(), #{watch => true})),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, []}, next()),
    %% #{} and watch => false are register/3 (and undefined: no reply).
    ok = actor_receptionist:register(K, P, self(), #{}),
    ?assertEqual({registered, K, P}, next()),
    ok = actor_receptionist:register(K, Q, undefined, #{watch => false}),
    stop_all([P, Q]),
    %% A watched one that dies after them: once it is gone, the server has
    %% seen all three deaths, and kept the two unwatched refs.
    W = spawn_idle(),
    ok = actor_receptionist:register(K, W, self(), #{watch => true}),
    ?assertEqual({registered, K, W}, next()),
    stop_all([W]),
    wait_until(fun() -> actor_receptionist:lookup(K) =:= [P, Q] end, ?WAIT_MS),
    barrier(),
    ?assertEqual([], drain()),
    [ok = actor_receptionist:deregister(K, R) || R <- [P, Q]].

deregister_ends_a_watch_and_the_first_watch_sticks(_Ctx) ->
    K = key(?FUNCTION_NAME),
    W0 = watched(),
    P = spawn_idle(), Q = spawn_idle(),
    %% P: watched, deregistered, registered again without: not watched.
    ok = actor_receptionist:register(K, P, self(), #{watch => true}),
    ?assertEqual(W0 + 1, watched_after({registered, K, P})),
    ok = actor_receptionist:deregister(K, P, self()),
    ?assertEqual(W0, watched_after({deregistered, K, P})),
    ok = actor_receptionist:register(K, P, self()),
    ?assertEqual(W0, watched_after({registered, K, P})),
    %% Q: registered, then again with watch (now watched), then again
    %% with watch => false (still watched).
    ok = actor_receptionist:register(K, Q, self()),
    ?assertEqual(W0, watched_after({registered, K, Q})),
    ok = actor_receptionist:register(K, Q, self(), #{watch => true}),
    ?assertEqual(W0 + 1, watched_after({registered, K, Q})),
    ok = actor_receptionist:register(K, Q, self(), #{watch => false}),
    ?assertEqual(W0 + 1, watched_after({registered, K, Q})),
    stop_all([P, Q]),
    wait_until(fun() -> actor_receptionist:lookup(K) =:= [P] end, ?WAIT_MS),
    ?assertEqual(W0, watched()),
    ok = actor_receptionist:deregister(K, P).

a_gen_server_is_named_through_the_receptionist(_Ctx) ->
    %% Any term names one; this one is a tuple.
    Name = {?FUNCTION_NAME, 1},
    Via = {via, actor_receptionist, Name},
    K = actor_receptionist:name_key(Name),
    {ok, P} = gen_server:start_link(Via, ap_named_server, ok, []),
    %% Seen at once, by whereis_name and lookup.
    ?assertEqual(P, actor_receptionist:whereis_name(Name)),
    ?assertEqual([P], actor_receptionist:lookup(K)),
    ?assertEqual({P, node()}, gen_server:call(Via, whoami)),
    ok = gen_server:cast(Via, {tell, self()}),
    ?assertEqual({told, P}, next()),
    ?assertEqual(P, actor_receptionist:send(Name, {'$gen_cast', {tell, self()}})),
    ?assertEqual({told, P}, next()),
    %% Taken.
    ?assertEqual({error, {already_started, P}}, gen_server:start(Via, ap_named_server, ok, [])),
    %% It stops: the next one gets the name at once (its old holder's DOWN
    %% may not have reached the receptionist yet), and the old one goes.
    ok = gen_server:stop(Via),
    {ok, P2} = gen_server:start(Via, ap_named_server, ok, []),
    ?assertEqual(P2, actor_receptionist:whereis_name(Name)),
    wait_until(fun() -> actor_receptionist:lookup(K) =:= [P2] end, ?WAIT_MS),
    %% And when it stops with nobody after it, the name frees.
    ok = gen_server:stop(P2),
    ?assertEqual(undefined, actor_receptionist:whereis_name(Name)),
    wait_until(fun() -> actor_receptionist:lookup(K) =:= [] end, ?WAIT_MS),
    ?assertExit({noproc, _}, gen_server:call(Via, whoami)),
    ok = gen_server:cast(Via, {tell, self()}),
    ?assertExit({badarg, {Name, hello}}, actor_receptionist:send(Name, hello)),
    %% An init that fails gives the name back before start returns.
    ?assertEqual({error, normal}, gen_server:start(Via, ap_named_server, {stop, normal}, [])),
    ?assertEqual(undefined, actor_receptionist:whereis_name(Name)),
    ?assertEqual([], drain()).

via_names_are_keys_and_one_member_gives_a_name_once(_Ctx) ->
    Bin = atom_to_binary(?FUNCTION_NAME),
    %% A key or an id is that key; other terms are their external format.
    ?assertEqual(actor_receptionist:service_key(Bin), actor_receptionist:name_key(Bin)),
    ?assertEqual(actor_receptionist:service_key(Bin), actor_receptionist:name_key(?FUNCTION_NAME)),
    ?assertEqual(actor_receptionist:service_key(Bin),
                 actor_receptionist:name_key(actor_receptionist:service_key(Bin))),
    ?assertEqual({service_key, term_to_binary({x, 1}, [deterministic, {minor_version, 2}])},
                 actor_receptionist:name_key({x, 1})),
    TooLong = {binary:copy(<<"x">>, 1024)},
    ?assertError(badarg, actor_receptionist:name_key(TooLong)),
    ?assertError(badarg, actor_receptionist:register_name(TooLong, self())),
    ?assertError(badarg, actor_receptionist:register_name(Bin, not_a_pid)),
    ?assertEqual(undefined, actor_receptionist:whereis_name(TooLong)),
    ?assertEqual(ok, actor_receptionist:unregister_name(TooLong)),
    K = actor_receptionist:service_key(Bin),
    %% register_name: yes, then no for anyone (the holder too); the name is
    %% found under its key at once, and watched.
    W0 = watched(),
    P = spawn_idle(), Q = spawn_idle(),
    ?assertEqual(yes, actor_receptionist:register_name(Bin, P)),
    ?assertEqual(P, actor_receptionist:whereis_name(Bin)),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, [P]}, next()),
    ?assertEqual(W0 + 1, watched()),
    ?assertEqual(no, actor_receptionist:register_name(Bin, Q)),
    ?assertEqual(no, actor_receptionist:register_name(Bin, P)),
    %% unregister_name frees it before it returns.
    ?assertEqual(ok, actor_receptionist:unregister_name(Bin)),
    ?assertEqual(undefined, actor_receptionist:whereis_name(Bin)),
    ?assertEqual(W0, watched()),
    ?assertEqual(ok, actor_receptionist:unregister_name(Bin)),
    %% A plain registration under the key holds the name too, and
    %% unregister_name leaves it (it was not made as a name).
    ok = actor_receptionist:register(K, Q, self()),
    ?assertEqual({registered, K, Q}, next()),
    ?assertEqual(no, actor_receptionist:register_name(Bin, P)),
    ?assertEqual(Q, actor_receptionist:whereis_name(Bin)),
    ?assertEqual(ok, actor_receptionist:unregister_name(Bin)),
    ?assertEqual([Q], actor_receptionist:lookup(K)),
    %% Several refs under the key: the least pid, whatever the order.
    Rs = [spawn_idle() || _ <- lists:seq(1, 5)],
    [ok = actor_receptionist:register(K, R) || R <- lists:reverse(Rs)],
    barrier(),
    ?assertEqual(lists:min([Q | Rs]), actor_receptionist:whereis_name(Bin)),
    [ok = actor_receptionist:deregister(K, R) || R <- [Q | Rs]],
    barrier(),
    ?assertEqual(undefined, actor_receptionist:whereis_name(Bin)),
    %% An unwatched registration of a dead process of this node stays, but
    %% holds no name here.
    stop_all([Q]),
    ok = actor_receptionist:register(K, Q, self()),
    ?assertEqual({registered, K, Q}, next()),
    ?assertEqual(undefined, actor_receptionist:whereis_name(Bin)),
    ?assertEqual(yes, actor_receptionist:register_name(Bin, P)),
    ?assertEqual(P, actor_receptionist:whereis_name(Bin)),
    ?assertEqual(lists:sort([Q, P]), lists:sort(actor_receptionist:lookup(K))),
    ok = actor_receptionist:unregister_name(Bin),
    ?assertEqual([Q], actor_receptionist:lookup(K)),
    ok = actor_receptionist:deregister(K, Q),
    stop_all([P | Rs]).

a_supervisor_restarts_a_named_child_under_its_name(_Ctx) ->
    Name = atom_to_binary(?FUNCTION_NAME),
    {ok, Sup} = supervisor:start_link(ap_named_server, {sup, Name}),
    [{named, P1, worker, _}] = supervisor:which_children(Sup),
    ?assertEqual(P1, actor_receptionist:whereis_name(Name)),
    exit(P1, kill),
    wait_until(fun() ->
                       case supervisor:which_children(Sup) of
                           [{named, P, worker, _}] -> is_pid(P) andalso P =/= P1;
                           _ -> false
                       end
               end, ?WAIT_MS),
    [{named, P2, worker, _}] = supervisor:which_children(Sup),
    ?assertEqual(P2, actor_receptionist:whereis_name(Name)),
    wait_until(fun() -> actor_receptionist:lookup(Name) =:= [P2] end, ?WAIT_MS),
    ok = gen_server:stop(Sup),
    ?assertEqual(undefined, actor_receptionist:whereis_name(Name)),
    wait_until(fun() -> actor_receptionist:lookup(Name) =:= [] end, ?WAIT_MS).

%% The receptionist holds a watched registration of a process that has
%% died, and handles a register_name for its key before that process's
%% DOWN (a supervisor can restart a child before the receptionist hears of
%% the old one's death): the name is free, and the dead one goes with its
%% DOWN. Made deterministic by suspending the server: the registration of
%% a dead process, then the call, queue up in that order, and the DOWN
%% (noproc, from the monitor the registration sets) comes after both.
a_dead_holder_frees_its_name_before_its_down_arrives(_Ctx) ->
    Name = atom_to_binary(?FUNCTION_NAME),
    Dead = spawn_idle(),
    stop_all([Dead]),
    New = spawn_idle(),
    Server = whereis(actor_receptionist_server),
    ok = sys:suspend(Server),
    Self = self(),
    try
        ok = actor_receptionist:register(Name, Dead, undefined, #{watch => true}),
        spawn_link(fun() -> Self ! {answer, actor_receptionist:register_name(Name, New)} end),
        wait_until(fun() ->
                           {messages, Msgs} = process_info(Server, messages),
                           lists:any(fun({'$gen_call', _, {register_name, _, _}}) -> true;
                                        (_) -> false
                                     end, Msgs)
                   end, ?WAIT_MS)
    after
        ok = sys:resume(Server)
    end,
    ?assertEqual({answer, yes}, next()),
    ?assertEqual(New, actor_receptionist:whereis_name(Name)),
    wait_until(fun() -> actor_receptionist:lookup(Name) =:= [New] end, ?WAIT_MS),
    ok = actor_receptionist:unregister_name(Name),
    stop_all([New]).

%% ===================================================================
%% Durability
%% ===================================================================

receptionist_crash_is_replayed(#{rcpt_node := Node}) ->
    K = key(?FUNCTION_NAME),
    Refs = [spawn_idle() || _ <- lists:seq(1, 5)],
    [ok = actor_receptionist:register(K, R) || R <- Refs],
    ok = actor_receptionist:subscribe(K, self()),
    ?assertEqual({listing, K, Refs}, next()),
    #{os_pid := OsPid, restarts := R0} = actor_cnode:info(actor_receptionist_owner),
    Shm = "/dev/shm" ++ actor_receptionist_server:shm_name(Node),
    {ok, #file_info{inode = Inode0}} = file:read_file_info(Shm),
    os:cmd("kill -9 " ++ integer_to_list(OsPid)),
    wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
    %% Lookups answer from the last snapshot, whether or not the new
    %% incarnation is up yet.
    ?assertEqual(Refs, actor_receptionist:lookup(K)),
    %% Once the owner has seen the exit (and so told the server), a request
    %% is queued while the C node is down, or sent if it is back already:
    %% either way it is not lost.
    wait_until(fun() ->
                       case actor_cnode:info(actor_receptionist_owner) of
                           #{status := down} -> true;
                           #{restarts := R} -> R > R0
                       end
               end, ?WAIT_MS),
    New = spawn_idle(),
    ok = actor_receptionist:register(K, New, self()),
    %% The subscriber gets a current listing from the new incarnation, and
    %% the new registration is acknowledged and listed.
    Got = until_listed(K, New, []),
    ?assert(lists:member({registered, K, New}, Got)),
    Listings = [L || {listing, _, L} <- Got],
    ?assertEqual(Refs ++ [New], lists:last(Listings)),
    ?assert(lists:all(fun(L) -> L =:= Refs orelse L =:= Refs ++ [New] end, Listings)),
    barrier(),
    ?assertEqual([], drain()),
    wait_until(fun() -> maps:get(status, actor_cnode:info(actor_receptionist_owner)) =:= up end,
               ?WAIT_MS),
    #{restarts := R1, status := up} = actor_cnode:info(actor_receptionist_owner),
    ?assertEqual(R0 + 1, R1),
    %% A new segment replaced the old one and the NIF follows it.
    {ok, #file_info{inode = Inode1}} = file:read_file_info(Shm),
    ?assertNotEqual(Inode0, Inode1),
    ?assertEqual(Refs ++ [New], actor_receptionist:lookup(K)),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, Refs ++ [New]}, next()),
    ok = actor_receptionist:unsubscribe(K, self()),
    stop_all([New | Refs]).

requests_while_down_are_applied_once_back(_Ctx) ->
    %% A slow restart leaves a window in which requests are queued.
    with_env(#{receptionist_node_opts => #{backoff => #{min_ms => 1500, max_ms => 2000}}}, fun() ->
        K = key(?FUNCTION_NAME),
        A = spawn_idle(),
        B = spawn_idle(),
        ok = actor_receptionist:register(K, A, self()),
        {registered, K, A} = next(),
        S = spawn_collector(),
        #{os_pid := OsPid} = actor_cnode:info(actor_receptionist_owner),
        os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        wait_until(fun() -> maps:get(status, actor_cnode:info(actor_receptionist_owner)) =:= down end,
                   ?WAIT_MS),
        ok = actor_receptionist:subscribe(K, S),
        ok = actor_receptionist:register(K, B, self()),
        ok = actor_receptionist:find(K, self()),
        ?assertMatch(#{status := down, queued := 3}, actor_receptionist:stats()),
        %% Back: each is applied once, in order.
        ?assertEqual({registered, K, B}, next()),
        ?assertEqual({listing, K, [A, B]}, next()),
        barrier(),
        ?assertEqual([{listing, K, [A, B]}], collected(S)),
        ?assertEqual([A, B], actor_receptionist:lookup(K)),
        stop_all([A, B, S])
    end).

server_crash_restarts_the_node_and_keeps_the_journal(_Ctx) ->
    K = key(?FUNCTION_NAME),
    A = spawn_idle(),
    ok = actor_receptionist:register(K, A, self()),
    {registered, K, A} = next(),
    S = spawn_collector(),
    ok = actor_receptionist:subscribe(K, S),
    barrier(),
    ?assertEqual([{listing, K, [A]}], collected(S)),
    #{restarts := R0} = actor_cnode:info(actor_receptionist_owner),
    Server = whereis(actor_receptionist_server),
    exit(Server, kill),
    wait_until(fun() -> is_pid(whereis(actor_receptionist_server))
                            andalso whereis(actor_receptionist_server) =/= Server end, ?WAIT_MS),
    %% The C node may hold changes the journal lost with the server: it is
    %% restarted and the journal replayed into it.
    wait_restarted(R0),
    barrier(),
    ?assertEqual([{listing, K, [A]}, {listing, K, [A]}], collected(S)),
    ?assertEqual([A], actor_receptionist:lookup(K)),
    %% The new server took the subscription over: counted, and watched.
    ?assertMatch(#{local_subscriptions := 1}, actor_receptionist:stats()),
    stop_all([S]),
    wait_until(fun() -> maps:get(local_subscriptions, actor_receptionist:stats()) =:= 0 end, ?WAIT_MS),
    stop_all([A]).

%% The watches are in the journal: a restarted server watches again, and a
%% watched process that died while no server ran goes at the restart.
a_watch_survives_a_server_restart(_Ctx) ->
    K = key(?FUNCTION_NAME),
    P = spawn_idle(), Q = spawn_idle(),
    ok = actor_receptionist:register(K, P, self(), #{watch => true}),
    {registered, K, P} = next(),
    ok = actor_receptionist:register(K, Q, self(), #{watch => true}),
    {registered, K, Q} = next(),
    #{restarts := R0} = actor_cnode:info(actor_receptionist_owner),
    %% The supervisor, suspended, restarts the server only once Q is dead.
    ok = sys:suspend(actor_receptionist_sup),
    Server = whereis(actor_receptionist_server),
    try
        Mref = monitor(process, Server),
        exit(Server, kill),
        receive {'DOWN', Mref, _, _, _} -> ok end,
        stop_all([Q])
    after
        ok = sys:resume(actor_receptionist_sup)
    end,
    wait_until(fun() -> is_pid(whereis(actor_receptionist_server)) end, ?WAIT_MS),
    wait_restarted(R0),
    wait_until(fun() -> actor_receptionist:lookup(K) =:= [P] end, ?WAIT_MS),
    stop_all([P]),
    wait_until(fun() -> actor_receptionist:lookup(K) =:= [] end, ?WAIT_MS).

lost_connection_restarts_the_node_and_keeps_the_journal(#{rcpt_node := Node}) ->
    K = key(?FUNCTION_NAME),
    A = spawn_idle(),
    ok = actor_receptionist:register(K, A, self()),
    {registered, K, A} = next(),
    #{restarts := R0} = actor_cnode:info(actor_receptionist_owner),
    true = erlang:disconnect_node(Node),
    wait_restarted(R0),
    B = spawn_idle(),
    ok = actor_receptionist:register(K, B, self()),
    ?assertEqual({registered, K, B}, next()),
    ?assertEqual([A, B], actor_receptionist:lookup(K)),
    stop_all([A, B]).

deeply_nested_message_does_not_crash_the_node(#{rcpt_node := Node}) ->
    %% Not something the server sends: any process can write to the C node.
    %% A term nested beyond what the C node accepts closes the connection
    %% (logged); the server restarts the node and nothing is lost.
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:register(K, self(), self()),
    {registered, K, _} = next(),
    #{restarts := R0} = actor_cnode:info(actor_receptionist_owner),
    ok = logger:add_handler(?MODULE, ?MODULE, #{level => warning, config => #{pid => self()}}),
    try
        Deep = lists:foldl(fun(_, Acc) -> {Acc} end, x, lists:seq(1, 100000)),
        {actor_receptionist, Node} ! {send, self(), Deep},
        %% The C node refused it with a log line (it did not crash) ...
        receive
            {cnode_log, Node, Text} ->
                ?assertNotEqual(nomatch, string:find(Text, "malformed"))
        after ?WAIT_MS ->
            error(no_log_line)
        end
    after
        ok = logger:remove_handler(?MODULE)
    end,
    %% ... and the server restarted it, since what was in flight is unknown.
    wait_restarted(R0),
    ok = actor_receptionist:find(K, self()),
    ?assertEqual({listing, K, [self()]}, next()).

%% ===================================================================
%% Segments of C nodes that died
%% ===================================================================

a_killed_c_node_leaves_no_segment(#{rcpt_node := Node}) ->
    %% A slow restart, so that the time between the two incarnations shows.
    with_env(#{receptionist_node_opts => #{backoff => #{min_ms => 1500, max_ms => 2000}}}, fun() ->
        Shm = ap_test_util:segment(Node),
        ?assert(filelib:is_file(Shm)),
        #{os_pid := OsPid, restarts := R0} = actor_cnode:info(actor_receptionist_owner),
        os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        %% The owner unlinks it when it sees the exit, before it reports down.
        wait_until(fun() -> maps:get(status, actor_cnode:info(actor_receptionist_owner)) =:= down end,
                   ?WAIT_MS),
        ?assertNot(filelib:is_file(Shm)),
        %% The next incarnation writes a new one, and lookups follow it.
        wait_restarted(R0),
        ?assert(filelib:is_file(Shm)),
        K = key(?FUNCTION_NAME),
        ok = actor_receptionist:register(K, self(), self()),
        {registered, K, _} = next(),
        ?assertEqual([self()], actor_receptionist:lookup(K))
    end).

a_starting_node_sweeps_orphans_and_keeps_live_segments(#{rcpt_node := Node}) ->
    Beam = list_to_integer(os:getpid()),
    Start = proc_start(Beam),
    {ok, #file_info{inode = Ns}} = file:read_file_info("/proc/self/ns/pid"),
    Dead = dead_os_pid(),
    %% A live receptionist C node besides the application's (started first:
    %% it sweeps at its own start).
    {ok, Other} = actor_cnode:start_link(#{exe => rcpt_exe(), name => ap_test_util:alive("sweep_other"),
                                           shm => true, args => ["--shm-mb", "2"]}),
    OtherShm = ap_test_util:segment(actor_cnode:node(Other)),
    %% Layout 5 (its writer held a lock, nobody holds it now): gone, even
    %% when the stamp names this running BEAM with its very start time
    %% (stamps are no evidence: a foreign /proc or a time namespace fakes
    %% them). Layout 4 (writers that never locked): gone only if nobody
    %% has the pid. A file that is not a snapshot; a FIFO.
    Fakes = #{dead => fake_segment("dead", header(5, Dead, Start, Ns)),
              stamped => fake_segment("stamped", header(5, Beam, Start, Ns)),
              old_dead => fake_segment("old_dead", header(4, Dead, Start, Ns)),
              old_live => fake_segment("old_live", header(4, Beam, Start, Ns)),
              junk => fake_segment("junk", <<"not a snapshot">>)},
    Fifo = "/dev/shm/actor_pool." ++ ap_test_util:alive("sweep_fifo") ++ "@nohost",
    "" = os:cmd("mkfifo " ++ Fifo),
    ok = logger:add_handler(?MODULE, ?MODULE, #{level => notice, config => #{pid => self()}}),
    try
        ?assert(filelib:is_file(OtherShm)),
        #{restarts := R0} = actor_cnode:info(actor_receptionist_owner),
        ok = actor_cnode:restart(actor_receptionist_owner),
        wait_restarted(R0),
        %% Swept when the new incarnation started, before it was ready.
        [?assertNot(filelib:is_file(maps:get(F, Fakes))) || F <- [dead, stamped, old_dead]],
        [?assert(filelib:is_file(maps:get(F, Fakes))) || F <- [old_live, junk]],
        ?assertMatch({ok, #file_info{type = other}}, file:read_link_info(Fifo)),
        ?assert(filelib:is_file(OtherShm)),
        ?assert(filelib:is_file(ap_test_util:segment(Node))),
        %% What the operator sees: a line per removal, a line per file of
        %% ours that is no snapshot, one summary line for the rest.
        Want = [{"removed orphaned snapshot " ++ maps:get(dead, Fakes), "is gone"},
                {"removed orphaned snapshot " ++ maps:get(stamped, Fakes), "is gone"},
                {"removed orphaned snapshot " ++ maps:get(old_dead, Fakes), "is gone"},
                {"left " ++ maps:get(junk, Fakes) ++ " alone", "not a snapshot"},
                {"snapshot sweep of /dev/shm/actor_pool.*", "not ours"}],
        await_log_lines(Node, Want),
        %% The live node's own segment goes with it when it stops.
        ok = actor_cnode:stop(Other),
        ?assertNot(filelib:is_file(OtherShm))
    after
        ok = logger:remove_handler(?MODULE),
        catch actor_cnode:stop(Other),
        [file:delete(F) || F <- [Fifo | maps:values(Fakes)]],
        flush_logs()
    end,
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:register(K, self(), self()),
    {registered, K, _} = next(),
    ?assertEqual([self()], actor_receptionist:lookup(K)).

a_second_node_never_takes_a_live_segment(#{rcpt_node := Node}) ->
    %% A receptionist node told to write the running one's segment (as a
    %% second node started under a name in use would): it runs without.
    Shm = ap_test_util:segment(Node),
    {ok, #file_info{inode = Inode}} = file:read_file_info(Shm),
    ok = logger:add_handler(?MODULE, ?MODULE, #{level => error, config => #{pid => self()}}),
    {ok, Second} = actor_cnode:start_link(#{exe => rcpt_exe(), name => ap_test_util:alive("second"),
                                            args => ["--shm", actor_cnode:shm_name(Node),
                                                     "--shm-mb", "2"]}),
    try
        %% Ready means past its start: the segment is still the first one's.
        ?assertMatch({ok, #file_info{inode = Inode}}, file:read_file_info(Shm)),
        Second2 = actor_cnode:node(Second),
        await_log_lines(Second2, [{"snapshot " ++ actor_cnode:shm_name(Node),
                                   "is still held by its writer"}]),
        ?assertMatch(#{shm_state := none}, gen_server:call({actor_receptionist, Second2}, stats))
    after
        ok = logger:remove_handler(?MODULE),
        ok = actor_cnode:stop(Second),
        flush_logs()
    end,
    %% Untouched, also after the second one stopped.
    ?assertMatch({ok, #file_info{inode = Inode}}, file:read_file_info(Shm)),
    K = key(?FUNCTION_NAME),
    ok = actor_receptionist:register(K, self(), self()),
    {registered, K, _} = next(),
    ?assertEqual([self()], actor_receptionist:lookup(K)),
    ?assertMatch(#{mapped := true, state := live}, actor_nif:info()).

a_fifo_under_the_segment_name_never_hangs_the_owner(_Ctx) ->
    %% Anyone can create a FIFO in /dev/shm under a C node's segment name
    %% once that is free. Its owner, removing the dead incarnation's
    %% segment, must neither open it for reading (that blocks until a
    %% writer comes) nor follow it; restart and stop must work.
    {ok, Pid} = actor_cnode:start_link(#{exe => rcpt_exe(), name => ap_test_util:alive("fifo"),
                                         shm => true, args => ["--shm-mb", "2"]}),
    Node = actor_cnode:node(Pid),
    Shm = ap_test_util:segment(Node),
    try
        ?assert(filelib:is_file(Shm)),
        #{restarts := R0} = actor_cnode:info(Pid),
        ok = file:delete(Shm),
        "" = os:cmd("mkfifo " ++ Shm),
        %% A kill -9 and a new incarnation: the owner answers at once.
        ?assertEqual(ok, gen_server:call(Pid, restart, 5000)),
        wait_until(fun() ->
                           case actor_cnode:info(Pid) of
                               #{restarts := R, status := up} -> R > R0;
                               _ -> false
                           end
                   end, ?WAIT_MS),
        %% The new incarnation runs without a snapshot: the name is not
        %% its to take.
        ?assertMatch(#{shm_state := none}, gen_server:call({actor_receptionist, Node}, stats)),
        ?assertMatch({ok, #file_info{type = other}}, file:read_link_info(Shm)),
        ?assertEqual(ok, actor_cnode:stop(Pid))
    after
        catch actor_cnode:stop(Pid),
        file:delete(Shm)
    end.

an_immediate_restart_after_the_owner_dies_gets_a_live_snapshot(_Ctx) ->
    %% The owner dies (its C node then exits on stdin EOF) and a new owner
    %% starts the same node at once: the new incarnation must wait for
    %% the old one's segment to go and write its own, not run without.
    process_flag(trap_exit, true),
    Opts = #{exe => rcpt_exe(), name => ap_test_util:alive("reborn"), shm => true,
             args => ["--shm-mb", "2"]},
    {ok, P0} = actor_cnode:start_link(Opts),
    try
        Last = lists:foldl(
                 fun(_, P) ->
                         exit(P, kill),
                         receive {'EXIT', P, _} -> ok end,
                         {ok, P2} = actor_cnode:start_link(Opts),
                         ok = actor_cnode:await_up(P2, ?WAIT_MS),
                         Node = actor_cnode:node(P2),
                         ?assertMatch(#{shm_state := live},
                                      gen_server:call({actor_receptionist, Node}, stats)),
                         P2
                 end, P0, lists:seq(1, 3)),
        ok = actor_cnode:stop(Last),
        receive {'EXIT', Last, _} -> ok after ?WAIT_MS -> error(no_exit) end
    after
        process_flag(trap_exit, false)
    end.

%% Log lines of C node Node, each holding both strings of one of Want, in
%% any order, among others.
await_log_lines(_Node, []) ->
    ok;
await_log_lines(Node, Want) ->
    receive
        {cnode_log, Node, Text} ->
            await_log_lines(Node, [W || {A, B} = W <- Want,
                                        string:find(Text, A) =:= nomatch
                                            orelse string:find(Text, B) =:= nomatch])
    after ?WAIT_MS ->
        error({log_lines_missing, Want})
    end.

%% Log lines the handler sent before it was removed.
flush_logs() ->
    receive {cnode_log, _, _} -> flush_logs()
    after 0 -> ok
    end.

%% A file in /dev/shm named like a receptionist's snapshot of this test
%% node (ap_test_util:own_segments/0 sees it), 0600 as a writer makes it.
fake_segment(Tag, Bin) ->
    Path = "/dev/shm/actor_pool." ++ ap_test_util:alive("sweep_" ++ Tag) ++ "@nohost",
    ok = file:write_file(Path, Bin),
    ok = file:change_mode(Path, 8#600),
    Path.

%% A snapshot header (c_src/shm/ap_shm.h) of this layout with this writer
%% stamp, padded to its 4096 bytes.
header(Layout, Pid, Start, Ns) ->
    Node = <<"sweep@nohost">>,
    Bin = <<16#31535450435241:64/native, Layout:32/native, 4096:32/native,
            (1 bsl 20):64/native, 0:64, 0:64, 0:64, Pid:64/native, 1:64/native,
            1:32/native, 0:32, 1:64/native, 0:64,
            Node/binary, 0:((256 - byte_size(Node)) * 8),
            Start:64/native, Ns:64/native>>,
    <<Bin/binary, 0:((4096 - byte_size(Bin)) * 8)>>.

%% Field 22 of /proc/PID/stat: the start time in clock ticks after boot.
proc_start(OsPid) ->
    {ok, Stat} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/stat"),
    [_, After] = string:split(Stat, ")", trailing),
    binary_to_integer(lists:nth(20, string:lexemes(After, " \n"))).

%% The pid of a shell that has exited.
dead_os_pid() ->
    Pid = list_to_integer(string:trim(os:cmd("echo $$"))),
    wait_until(fun() -> not os_pid_alive(Pid) end, ?WAIT_MS),
    Pid.

rcpt_exe() ->
    os:getenv("ACTOR_RECEPTIONIST_NODE_EXE", "actor_receptionist_node").

%% logger handler callback: C-node log lines (of the handler's level or
%% above) go to the test process.
log(#{msg := {Format, Args}, meta := #{cnode := Node}}, #{config := #{pid := Pid}})
  when is_list(Format) ->
    Pid ! {cnode_log, Node, lists:flatten(io_lib:format(Format, Args))};
log(_Event, _Config) ->
    ok.

%% ===================================================================
%% Helpers
%% ===================================================================

key(Name) ->
    actor_receptionist:service_key(iolist_to_binary(io_lib:format("~0p", [Name]))).

%% Messages until both the acknowledgement of New and a listing with New
%% under K have come.
until_listed(K, New, Acc0) ->
    Acc = Acc0 ++ [next()],
    case lists:member({registered, K, New}, Acc)
        andalso lists:any(fun({listing, K1, L}) -> K1 =:= K andalso lists:member(New, L);
                             (_) -> false
                          end, Acc) of
        true -> Acc;
        false -> until_listed(K, New, Acc)
    end.

%% The next message, which must come within WAIT_MS.
next() ->
    receive Msg -> Msg
    after ?WAIT_MS -> error(no_message)
    end.

drain() ->
    receive Msg -> [Msg | drain()]
    after 0 -> []
    end.

barrier() ->
    ap_test_util:rcpt_barrier().

spawn_idle() ->
    spawn(fun() -> receive stop -> ok end end).

%% How many registrations of this node are watched.
watched() ->
    #{watched_registrations := N} = actor_receptionist:stats(),
    N.

%% Once Reply (the acknowledgement of this process's last request) came.
watched_after(Reply) ->
    ?assertEqual(Reply, next()),
    watched().

%% The receptionist C node is up again, one incarnation after R0.
wait_restarted(R0) ->
    wait_until(fun() ->
                       case actor_cnode:info(actor_receptionist_owner) of
                           #{restarts := R, status := up} -> R =:= R0 + 1;
                           _ -> false
                       end
               end, ?WAIT_MS).

stop_all(Pids) ->
    [begin
         Mref = monitor(process, P),
         P ! stop,
         receive {'DOWN', Mref, _, _, _} -> ok end
     end || P <- Pids],
    ok.

%% Run Fun with the receptionist restarted under Env, then restarted again
%% with the keys of Env unset (the defaults).
with_env(Env, Fun) ->
    restart_receptionist(Env),
    try Fun()
    after
        maps:foreach(fun(K, _) -> application:unset_env(actor_pool, K) end, Env),
        restart_receptionist(#{})
    end.

restart_receptionist(Env) ->
    maps:foreach(fun(K, V) -> ok = application:set_env(actor_pool, K, V) end, Env),
    ok = supervisor:terminate_child(actor_pool_sup, actor_receptionist_sup),
    {ok, _} = supervisor:restart_child(actor_pool_sup, actor_receptionist_sup),
    ok.
