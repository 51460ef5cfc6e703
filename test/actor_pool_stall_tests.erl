%% Stuck work contained by default: a worker busy on one message past the
%% pool's `stall_ms' (default 1000) is stalled (routing skips it, the
%% messages queued behind it move to the other workers, one warning names
%% the pool, the worker and the time, `stats/1' shows it), a process-mode
%% pool kills a stuck worker process after its default `handler_timeout_ms'
%% (5000), and `stop_pool/1' kills a busy worker process within a second.
%%
%% Against the real pool node the application starts, with the test plugin
%% plugin_crash.so (`{spin, infinity}' never returns, `{spin, Ms}' spins that
%% long, `whoami' answers the worker's index), in both isolation modes (a
%% thread cannot be killed: its spins end on their own) and over both
%% transports (same-host rings, and distribution with `fast_path => false').
%% Every wait polls with a deadline; the one fixed wait is the acceptance
%% case's own 1.5 s.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the pool node's I/O backend.
-module(actor_pool_stall_tests).

-import(ap_test_util, [with_pool/4, crash_plugin/0]).
-import(ap_support, [poll/3, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

-export([forty_of_forty_asks_succeed_1500_ms_after_a_handler_got_stuck/1,
         asks_and_tells_queued_behind_a_stuck_message_are_handled_by_the_others/1,
         a_stall_is_logged_once_naming_pool_worker_and_time/1,
         stats_show_a_stalled_worker_and_for_how_long/1,
         a_stuck_worker_process_is_killed_after_the_default_timeout/1,
         stop_pool_kills_a_spinning_worker_process_within_a_second/1,
         stall_ms_is_validated_and_defaults_are_filled_in_on_both_sides/1]).
-export([log/2]).

-define(WAIT_MS, 10000).
%% A thread's spin: it cannot be killed, so it must end on its own, well
%% after what the case looks at (a stall at about 1 s).
-define(THREAD_SPIN_MS, 4000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_pool_stall_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 forty_of_forty_asks_succeed_1500_ms_after_a_handler_got_stuck,
                 asks_and_tells_queued_behind_a_stuck_message_are_handled_by_the_others,
                 a_stall_is_logged_once_naming_pool_worker_and_time,
                 stats_show_a_stalled_worker_and_for_how_long,
                 a_stuck_worker_process_is_killed_after_the_default_timeout,
                 stop_pool_kills_a_spinning_worker_process_within_a_second,
                 stall_ms_is_validated_and_defaults_are_filled_in_on_both_sides]]
     end}.

case_(Name, Ctx) ->
    {atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}.

setup() -> ap_test_util:pool_setup().

cleanup(Ctx) -> ap_test_util:pool_cleanup(Ctx).

%% Both isolation modes over both transports; the options are the
%% defaults but for the size (and the mode and transport chosen).
variants() ->
    [{Iso, Path} || Iso <- [process, thread], Path <- [ring, dist]].

opts({Iso, Path}) ->
    O = #{workers => 2},
    O1 = case Iso of
             process -> O;
             thread -> O#{isolation => thread}
         end,
    case Path of
        ring -> O1;
        dist -> O1#{fast_path => false}
    end.

%% A process can be stuck for ever (it is killed); a thread must return.
stuck({process, _}) -> {spin, infinity};
stuck({thread, _}) -> {spin, ?THREAD_SPIN_MS}.

name(Case, {Iso, Path}) ->
    list_to_atom(lists:concat([Case, "_", Iso, "_", Path])).

%% ===================================================================
%% The issue's acceptance case
%% ===================================================================

%% With default options, 1.5 s after one handler got stuck in a 2-worker
%% pool, 40 of 40 asks succeed: the stuck worker gets none of them. Before,
%% round robin sent half of them behind the stuck message, for ever.
forty_of_forty_asks_succeed_1500_ms_after_a_handler_got_stuck(_Ctx) ->
    [with_pool(name(?FUNCTION_NAME, V), crash_plugin(), opts(V), fun(P) ->
         all_running(P),
         T0 = erlang:monotonic_time(millisecond),
         ok = actor_pool:tell(P, stuck(V)),
         receive after max(0, T0 + 1500 - erlang:monotonic_time(millisecond)) -> ok end,
         Results = parallel([fun() -> actor_pool:ask(P, {n, I}, 2000) end || I <- lists:seq(1, 40)]),
         ?assertEqual({V, [{ok, {n, I}} || I <- lists:seq(1, 40)]}, {V, Results})
     end) || V <- variants()],
    ok.

%% ===================================================================
%% The queue moves
%% ===================================================================

%% Round robin puts every other message behind the stuck one (the stuck
%% tell goes first, from this process). Once the worker is stalled they
%% move: every ask is answered by the other worker, well before the stuck
%% message could end (an ask waits 4 s: less than a worker process's
%% default deadline, and than a thread's spin), and every tell is handled
%% there too, each message once. In process mode those behind it were sent
%% to the stuck process already: it hands them back unrun.
asks_and_tells_queued_behind_a_stuck_message_are_handled_by_the_others(_Ctx) ->
    [with_pool(name(?FUNCTION_NAME, V), crash_plugin(), opts(V), fun(P) ->
         all_running(P),
         ok = actor_pool:tell(P, stuck(V)),
         Stuck = wait_busy_worker(P),
         [Other] = [Id || #{id := Id} <- workers(actor_pool:stats(P)), Id =/= Stuck],
         Self = self(),
         Askers = [spawn_link(fun() -> Self ! {asked, self(), actor_pool:ask(P, <<"whoami">>, 4000)} end)
                   || _ <- lists:seq(1, 20)],
         [ok = actor_pool:tell(P, {t, I}) || I <- lists:seq(1, 10)],
         Answers = [receive {asked, A, R} -> R after ?WAIT_MS -> {no_answer, A} end || A <- Askers],
         ?assertEqual({V, [{ok, Other} || _ <- Askers]}, {V, Answers}),
         %% The tells too, each once: 30 messages on the other worker.
         Done = stats_when(P, fun(S) -> maps:get(processed, worker(Other, S)) >= 30 end),
         ?assertEqual({V, 30}, {V, maps:get(processed, worker(Other, Done))}),
         ?assertMatch(#{state := stalled, mailbox := 1}, worker(Stuck, Done)),
         ?assertEqual({V, []}, {V, flush_mailbox()})
     end) || V <- variants()],
    ok.

%% ===================================================================
%% What a user sees
%% ===================================================================

%% One warning per stall, from the pool node through logger, naming the
%% pool, the worker and how long it has been busy; nothing more while it
%% stays stalled (the watchdog looks ten times a second).
a_stall_is_logged_once_naming_pool_worker_and_time(_Ctx) ->
    Id = add_log_handler(),
    try
        [with_pool(name(?FUNCTION_NAME, V), crash_plugin(), opts(V), fun(P) ->
             Name = name(?FUNCTION_NAME, V),
             all_running(P),
             ok = actor_pool:tell(P, stuck(V)),
             S = stats_when(P, fun(S) -> [W || #{state := stalled, busy_ms := B} = W <- workers(S),
                                               B >= 2000] =/= [] end),
             [#{id := Stuck}] = [W || #{state := stalled} = W <- workers(S)],
             Lines = stall_lines(Name),
             ?assertMatch({V, [_]}, {V, Lines}),
             [Line] = Lines,
             Re = "^pool " ++ atom_to_list(Name) ++ ": worker " ++ integer_to_list(Stuck)
                 ++ " has been busy on one message for ([0-9]+) ms",
             {match, [Ms]} = re:run(Line, Re, [{capture, all_but_first, list}]),
             ?assert(list_to_integer(Ms) >= 1000)
         end) || V <- [{process, ring}, {thread, ring}]],
        ok
    after
        ok = logger:remove_handler(Id)
    end.

%% The stalled worker in stats/1: state stalled, not alive, busy_ms since it
%% got the message (growing), the pool's stall_ms and stalls; the other
%% worker serves. A thread's message ends: it serves again, busy_ms 0.
stats_show_a_stalled_worker_and_for_how_long(_Ctx) ->
    [with_pool(name(?FUNCTION_NAME, V), crash_plugin(), opts(V), fun(P) ->
         all_running(P),
         ok = actor_pool:tell(P, stuck(V)),
         S1 = stats_when(P, fun(S) -> [W || #{state := stalled} = W <- workers(S)] =/= [] end),
         [#{id := Stuck, busy_ms := B1} = W1] = [W || #{state := stalled} = W <- workers(S1)],
         ?assertMatch({V, #{alive := false, mailbox := 1}}, {V, W1}),
         ?assert(B1 >= 1000),
         ?assertMatch(#{stall_ms := 1000, stalls := 1}, S1),
         %% The metrics say so too: the stall counted.
         Line = io_lib:format("actor_pool_stalls_total{pool=\"~s\",node=\"~s\"} 1\n",
                              [name(?FUNCTION_NAME, V), node(P)]),
         Text = iolist_to_binary(actor_pool_metrics:render()),
         ?assertNotEqual(nomatch, binary:match(Text, iolist_to_binary(Line))),
         [?assertMatch(#{state := running, alive := true, busy_ms := 0}, W)
          || #{id := Id} = W <- workers(S1), Id =/= Stuck],
         S2 = stats_when(P, fun(S) -> maps:get(busy_ms, worker(Stuck, S)) > B1 end),
         ?assertMatch(#{state := stalled}, worker(Stuck, S2)),
         case V of
             {thread, _} ->
                 S3 = stats_when(P, fun(S) -> maps:get(state, worker(Stuck, S)) =:= running end),
                 ?assertMatch(#{alive := true, busy_ms := 0, processed := 1}, worker(Stuck, S3)),
                 ?assertMatch(#{stalls := 1, crashes := 0}, S3),
                 ?assertEqual({ok, Stuck}, first_answer_from(P, Stuck));
             {process, _} ->
                 ok
         end
     end) || V <- [{process, ring}, {thread, ring}]],
    ok.

%% A process-mode pool's default handler_timeout_ms is 5000: the stuck
%% ask is answered handler_timeout, its process killed and replaced.
a_stuck_worker_process_is_killed_after_the_default_timeout(_Ctx) ->
    [with_pool(name(?FUNCTION_NAME, V), crash_plugin(), opts(V), fun(P) ->
         all_running(P),
         ?assertMatch(#{handler_timeout_ms := 5000}, actor_pool:stats(P)),
         T0 = erlang:monotonic_time(millisecond),
         ?assertEqual({error, handler_timeout}, actor_pool:ask(P, {spin, infinity}, 15000)),
         ?assert(erlang:monotonic_time(millisecond) - T0 >= 5000),
         S = stats_when(P, fun(#{crash_causes := #{timeout := T}} = S) ->
                                   T =:= 1 andalso all_running_stats(S)
                           end),
         ?assertMatch(#{crashes := 1, stalls := 1}, S),
         ?assertEqual({ok, x}, actor_pool:ask(P, x))
     end) || V <- [{process, ring}, {process, dist}]],
    ok.

%% stop_pool/1 returns at once; a worker process busy on a message that
%% never ends is killed within a second (0.5 s of grace), and its ask is
%% answered stopped.
stop_pool_kills_a_spinning_worker_process_within_a_second(_Ctx) ->
    Name = ?FUNCTION_NAME,
    {ok, P} = actor_pool:start_pool(Name, crash_plugin(), #{workers => 1}),
    try
        all_running(P),
        Self = self(),
        Asker = spawn_link(fun() -> Self ! {spun, actor_pool:ask(P, {spin, infinity}, ?WAIT_MS)} end),
        Busy = wait_busy_worker(P),
        #{os_pid := OsPid} = worker(Busy, actor_pool:stats(P)),
        ?assert(os_pid_alive(OsPid)),
        T0 = erlang:monotonic_time(millisecond),
        ?assertEqual(ok, actor_pool:stop_pool(P)),
        Left = max(0, T0 + 1000 - erlang:monotonic_time(millisecond)),
        ?assertEqual({ok, false}, poll(fun() -> os_pid_alive(OsPid) end, fun(A) -> not A end, Left)),
        receive
            {spun, R} -> ?assertEqual({error, stopped}, R)
        after ?WAIT_MS -> error({no_answer, Asker})
        end
    after
        _ = actor_pool:stop_pool(Name)
    end.

%% stall_ms: 1..86400000 or infinity, checked in the BEAM and again by the
%% pool node (any peer may ask it); the defaults (stall_ms 1000,
%% handler_timeout_ms 5000 for a process pool, infinity for a thread pool)
%% are filled in by both.
stall_ms_is_validated_and_defaults_are_filled_in_on_both_sides(#{pool_node := PN}) ->
    Bad = [0, -1, 86400001, 1.5, never, "1000"],
    [?assertEqual({V, {error, {badarg, {stall_ms, V}}}},
                  {V, actor_pool:start_pool(?FUNCTION_NAME, echo, #{stall_ms => V})}) || V <- Bad],
    [?assertEqual({V, {error, {badarg, {stall_ms, V}}}},
                  {V, gen_server:call({actor_pool_node, PN},
                                      {start_pool, ?FUNCTION_NAME, echo, #{stall_ms => V}}, ?WAIT_MS)})
     || V <- Bad],
    ?assertNot(lists:keymember(?FUNCTION_NAME, 1, actor_pool:which_pools())),
    %% The bounds and infinity pass: on to a pool node that does not exist.
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Nowhere = list_to_atom(ap_test_util:alive("nowhere") ++ "@" ++ Host),
    [?assertEqual({V, {error, {nodedown, Nowhere}}},
                  {V, actor_pool:start_pool(?FUNCTION_NAME, echo, #{stall_ms => V, node => Nowhere})})
     || V <- [1, 86400000, infinity]],
    %% What each side fills in, and what is given, as stats/1 shows it.
    Started = fun(Opts, Fun) ->
                      {ok, P} = gen_server:call({actor_pool_node, PN},
                                                {start_pool, ?FUNCTION_NAME, echo, Opts}, ?WAIT_MS),
                      try Fun(actor_pool:stats(P)) after ok = actor_pool:stop_pool(P) end
              end,
    Started(#{workers => 1}, fun(S) ->
        ?assertMatch(#{isolation := thread, stall_ms := 1000, handler_timeout_ms := infinity}, S)
    end),
    Started(#{workers => 1, isolation => process}, fun(S) ->
        ?assertMatch(#{isolation := process, stall_ms := 1000, handler_timeout_ms := 5000}, S)
    end),
    Started(#{workers => 1, isolation => process, stall_ms => infinity, handler_timeout_ms => infinity},
            fun(S) -> ?assertMatch(#{stall_ms := infinity, handler_timeout_ms := infinity}, S) end),
    with_pool(?FUNCTION_NAME, echo, #{workers => 1, stall_ms => 250}, fun(P) ->
        ?assertMatch(#{isolation := thread, stall_ms := 250, handler_timeout_ms := infinity},
                     actor_pool:stats(P))
    end),
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1}, fun(P) ->
        ?assertMatch(#{isolation := process, stall_ms := 1000, handler_timeout_ms := 5000},
                     actor_pool:stats(P))
    end).

%% ===================================================================
%% Helpers
%% ===================================================================

%% Runs the funs at once, each in a process of its own; their results in order.
parallel(Funs) ->
    Self = self(),
    Pids = [spawn_link(fun() -> Self ! {par, self(), F()} end) || F <- Funs],
    [receive {par, Pid, R} -> R after 2 * ?WAIT_MS -> error({par_timeout, Pid}) end || Pid <- Pids].

workers(#{workers := Ws}) -> Ws.

worker(Id, S) ->
    [W] = [W || #{id := I} = W <- workers(S), I =:= Id],
    W.

all_running_stats(S) ->
    lists:all(fun(#{state := St, alive := A}) -> St =:= running andalso A end, workers(S)).

%% Every worker up (a worker process starts after the pool does).
all_running(P) ->
    _ = stats_when(P, fun all_running_stats/1),
    ok.

stats_when(P, Pred) ->
    case poll(fun() -> actor_pool:stats(P) end,
              fun(#{} = S) -> Pred(S); (_) -> false end, ?WAIT_MS) of
        {ok, S} -> S;
        {timeout, Last} -> error({stats_condition_not_met, Last})
    end.

%% The worker that holds the one message sent (its mailbox gauge counts
%% the message it runs).
wait_busy_worker(P) ->
    S = stats_when(P, fun(S) -> [W || #{mailbox := 1} = W <- workers(S)] =/= [] end),
    [#{id := Id} | _] = [W || #{mailbox := 1} = W <- workers(S)],
    Id.

%% Asks `whoami' until worker Id answers (round robin gets there).
first_answer_from(P, Id) ->
    {_, R} = poll(fun() -> actor_pool:ask(P, <<"whoami">>) end, fun(R) -> R =:= {ok, Id} end, ?WAIT_MS),
    R.

flush_mailbox() ->
    receive M -> [M | flush_mailbox()] after 0 -> [] end.

%% ===================================================================
%% Log lines
%% ===================================================================

add_log_handler() ->
    Id = list_to_atom("stall_log_" ++ integer_to_list(erlang:unique_integer([positive]))),
    Tab = ets:new(?MODULE, [public, bag]),
    put(log_tab, Tab),
    ok = logger:add_handler(Id, ?MODULE, #{level => all, config => #{tab => Tab}}),
    Id.

%% The pool node's stall warnings about pool Name.
stall_lines(Name) ->
    Prefix = "pool " ++ atom_to_list(Name) ++ ":",
    [T || {warning, T} <- ets:tab2list(get(log_tab)), lists:prefix(Prefix, T),
          string:find(T, "busy on one message") =/= nomatch].

log(#{level := L, meta := #{cnode := _}, msg := {F, A}}, #{config := #{tab := Tab}}) ->
    ets:insert(Tab, {L, lists:flatten(io_lib:format(F, A))}),
    ok;
log(_Event, _Config) ->
    ok.
