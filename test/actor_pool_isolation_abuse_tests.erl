%% A worker process that turns on its own channel (isolation => process):
%% the pool node's proxy must not believe anything the child writes, and a
%% message the child dies taking in must cost one worker, once. The test
%% plugin plugin_hostile.so does what a broken plugin could (see its
%% header); the pool node is the real one the application starts.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the pool node's I/O backend.
-module(actor_pool_isolation_abuse_tests).

-import(ap_test_util, [with_pool/4]).
-import(ap_support, [wait_until/2]).

-include_lib("eunit/include/eunit.hrl").

-export([a_message_a_worker_dies_taking_in_costs_one_crash/0,
         a_broken_request_ring_costs_that_worker/0,
         a_child_writing_into_its_request_records_dies_alone/0,
         a_child_hiding_its_running_message_is_still_timed_out/0,
         a_child_claiming_unsent_messages_done_is_killed/0,
         a_child_claiming_an_ask_done_without_its_result_is_killed/0,
         a_child_that_silences_its_own_bell_only_waits/0,
         worker_stdout_is_not_the_pool_nodes/0]).

-define(ASK_MS, 20000).

hostile() ->
    {plugin, ap_support:test_bin("plugin_hostile.so")}.

actor_pool_isolation_abuse_test_() ->
    {setup, fun ap_test_util:start_app/0, fun ap_test_util:stop_app/1,
     [{atom_to_list(F), {timeout, 120, fun ?MODULE:F/0}}
      || F <- [a_message_a_worker_dies_taking_in_costs_one_crash,
               a_broken_request_ring_costs_that_worker,
               a_child_writing_into_its_request_records_dies_alone,
               a_child_hiding_its_running_message_is_still_timed_out,
               a_child_claiming_unsent_messages_done_is_killed,
               a_child_claiming_an_ask_done_without_its_result_is_killed,
               a_child_that_silences_its_own_bell_only_waits,
               worker_stdout_is_not_the_pool_nodes]]}.

causes(P) -> maps:get(crash_causes, actor_pool:stats(P)).

crashes(P) -> maps:get(crashes, actor_pool:stats(P)).

all_alive(P) ->
    lists:all(fun(#{alive := A, os_pid := O}) -> A andalso is_integer(O) end,
              maps:get(workers, actor_pool:stats(P))).

%% 40 MiB under a 16 MiB limit (ASan: its largest allocation, under a
%% limit its larger base fits in): the child dies taking the message in,
%% before any handler runs. It used to be moved to the next worker, which
%% died the same way, for ever, and the ask was never answered.
a_message_a_worker_dies_taking_in_costs_one_crash() ->
    Mb = case os:getenv("ACTOR_POOL_NODE_EXE") of
             false -> 16;
             _ -> 32
         end,
    Size = 40 bsl 20,
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 2, max_memory_mb => Mb},
              fun(P) ->
                      ok = (wait_until(fun() -> all_alive(P) end, ?ASK_MS)),
                      ?assertMatch({error, {worker_crashed, _}},
                                   actor_pool:ask(P, binary:copy(<<1>>, Size), ?ASK_MS)),
                      %% Both slots serve again, and nothing else died.
                      ok = (wait_until(fun() -> all_alive(P) end, ?ASK_MS)),
                      [?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS)) || _ <- [1, 2, 3, 4]],
                      ?assertEqual(1, crashes(P))
              end).

%% The child breaks the request ring while a large message waits for room
%% in it. The slot used to stay `running' with no crash, and every ask
%% routed to it timed out.
a_broken_request_ring_costs_that_worker() ->
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 1},
              fun(P) ->
                      Self = self(),
                      spawn_link(fun() -> Self ! {scribbled, actor_pool:ask(P, <<"break_req">>, ?ASK_MS)} end),
                      ok = (wait_until(fun() ->
                                                 [#{mailbox := M}] = maps:get(workers, actor_pool:stats(P)),
                                                 M =:= 1
                                         end, ?ASK_MS)),
                      %% Four times the request ring (512 KiB): it must
                      %% wait for room there.
                      Big = actor_pool:ask(P, binary:copy(<<1>>, 2000000), ?ASK_MS),
                      receive {scribbled, S} -> ?assertMatch({error, {worker_crashed, sigkill}}, S) end,
                      %% Queued behind the broken ring: moved (one slot: to
                      %% its replacement) and answered.
                      ?assertEqual({ok, 2000000}, Big),
                      ?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS)),
                      ?assertMatch(#{signal := 1}, causes(P))
              end).

%% The request ring's records are the pool node's only copy of the tells
%% it sent there without a job (bare tells), which it hands to another
%% worker if the child dies first: the child maps them read-only, so a
%% write there is the child's SIGSEGV, that worker's loss alone; the slot
%% comes back and serves.
a_child_writing_into_its_request_records_dies_alone() ->
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 2},
              fun(P) ->
                      ok = (wait_until(fun() -> all_alive(P) end, ?ASK_MS)),
                      ?assertEqual({error, {worker_crashed, sigsegv}},
                                   actor_pool:ask(P, <<"scribble_req">>, ?ASK_MS)),
                      ok = (wait_until(fun() -> all_alive(P) end, ?ASK_MS)),
                      [?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS)) || _ <- [1, 2, 3, 4]],
                      ?assertEqual(1, crashes(P)),
                      ?assertMatch(#{signal := 1}, causes(P))
              end).

%% The child spins clearing running_seq: the deadline is the pool node's.
a_child_hiding_its_running_message_is_still_timed_out() ->
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 1, handler_timeout_ms => 300},
              fun(P) ->
                      ?assertEqual({error, handler_timeout}, actor_pool:ask(P, <<"spin_hide">>, ?ASK_MS)),
                      ?assertMatch(#{timeout := 1}, causes(P)),
                      ?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS))
              end).

%% A tell that ran ok has no result record: the child's done_seq says it
%% is done. A child that claims more than it was sent is killed at once
%% (its handler sleeps 30 s: only that ends it), and the ask queued behind
%% it is answered by the replacement.
a_child_claiming_unsent_messages_done_is_killed() ->
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 1},
              fun(P) ->
                      ok = actor_pool:tell(P, <<"lie_done">>),
                      ?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS)),
                      ?assertMatch(#{signal := 1}, causes(P)),
                      ?assertEqual(1, crashes(P))
              end).

%% An ask always has a result record: done_seq past it without one is a
%% broken channel, and the ask is answered as the worker's crash.
a_child_claiming_an_ask_done_without_its_result_is_killed() ->
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 1},
              fun(P) ->
                      ?assertEqual({error, {worker_crashed, sigkill}},
                                   actor_pool:ask(P, <<"done_ask">>, ?ASK_MS)),
                      ?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS)),
                      ?assertMatch(#{signal := 1}, causes(P))
              end).

%% loop_looks is the pool node's word to a child: "the loop takes your
%% results on its passes, ring nobody". A child that raises it itself
%% (while the loop sleeps between lone asks) only delays its own answers:
%% its proxy still looks once a second, or the loop on its next pass, and
%% every ask is answered, in order, with nothing lost or killed.
a_child_that_silences_its_own_bell_only_waits() ->
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 1},
              fun(P) ->
                      ?assertEqual({ok, muted}, actor_pool:ask(P, <<"mute">>, ?ASK_MS)),
                      ?assertEqual([{ok, K} || K <- lists:seq(1, 3)],
                                   [actor_pool:ask(P, K, ?ASK_MS) || K <- lists:seq(1, 3)]),
                      ?assertEqual({ok, muted}, actor_pool:ask(P, <<"mute">>, ?ASK_MS)),
                      ?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS)),
                      ?assertMatch(#{processed := 6, crashes := 0}, actor_pool:stats(P))
              end).

%% A port-owned pool node's stdout is its {packet, 4} stream to the BEAM: a
%% worker process's printf must not land in it.
worker_stdout_is_not_the_pool_nodes() ->
    with_pool(?FUNCTION_NAME, hostile(), #{workers => 1},
              fun(P) ->
                      {ok, {Out, Err}} = actor_pool:ask(P, <<"fds">>, ?ASK_MS),
                      ?assertEqual(Err, Out),
                      ?assertEqual({ok, printed}, actor_pool:ask(P, <<"print">>, ?ASK_MS)),
                      %% The node still talks to its owner: a crash is
                      %% reported, the slot comes back.
                      [#{os_pid := Old}] = maps:get(workers, actor_pool:stats(P)),
                      os:cmd("kill -9 " ++ integer_to_list(Old)),
                      ok = (wait_until(fun() ->
                                                 [#{os_pid := O}] = maps:get(workers, actor_pool:stats(P)),
                                                 is_integer(O) andalso O =/= Old
                                         end, ?ASK_MS)),
                      ?assertEqual({ok, 3}, actor_pool:ask(P, <<"abc">>, ?ASK_MS))
              end).
