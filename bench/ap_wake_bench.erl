%% @doc Wake-up and scheduler latencies of the same-host transport: the
%% timing checks that were asserts in the unit tests (actor_dp_tests,
%% actor_pool_oversize_tests), where a loaded host fails them with nothing
%% wrong. Here, on the real pool node the application starts:
%% <ul>
%% <li>`short ask timeout after idle (ms)': asks by ring with a 2 ms
%%     timeout to a pool whose one worker sleeps on an earlier message,
%%     each after 60 ms of idle (the NIF's reply thread back in its 50 ms
%%     sleep): the time until `{error, timeout}', median of
%%     BENCH_WAKE_TIMEOUTS [9]. Target under 20 ms: the ask's deadline
%%     wakes the reply thread (else it is kept at the end of that sleep,
%%     up to 50 ms).</li>
%% <li>`answer after an await (ms)': after a lone ask whose answer the
%%     caller took in the NIF (actor_dp:await/3), an ask whose answer comes
%%     as a message: the time to it, median of BENCH_WAKE_AWAITS [21].
%%     Target under 10 ms: the caller raised the sleeping reply thread's
%%     flag again (a flag left down makes that answer wait for the end of
%%     the 50 ms sleep: median 25 ms).</li>
%% <li>`huge term refused, scheduler gap (ms)': an ask and a tell of a
%%     10M-element list (about 50 MB encoded) to a ring pool, from a process
%%     bound to its scheduler beside a ticker bound to the same one: the
%%     longest time the ticker went without running, the least of three
%%     tries (a vCPU the hypervisor takes away stops it too, but not on
%%     every try). Target under 50 ms (encoding the term in the NIF, or
%%     erlang:external_size/1, held the scheduler 100 ms and more).</li>
%% </ul>
%% The application runs with a `max_frame' of 64 KiB (the floor).
%% Knobs: BENCH_WAKE_TIMEOUTS, BENCH_WAKE_AWAITS, BENCH_WAKE_TIMEOUT_S (the
%% whole bench [120]), BENCH_STRICT=1 (exit 2 when a target is missed).
%% Every answer is checked; the pools and the application are stopped at
%% the end, also on failure.
-module(ap_wake_bench).

-import(ap_bench_util, [env_int/2, median/1]).

-export([main/0]).

-define(T, 10000).

-spec main() -> no_return().
main() ->
    ap_bench_util:main("wake", "BENCH_WAKE_TIMEOUT_S", 120, fun run/0,
                       [{"stopping the pools", fun stop_pools/0},
                        {"stopping the application", fun stop_app/0}]).

fail(Fmt, Args) -> throw({bench_failed, Fmt, Args}).

run() ->
    ok = actor_dist:ensure_distributed(),
    %% The floor (64 KiB): the huge term is refused as too large.
    _ = application:load(actor_pool),
    ok = application:set_env(actor_pool, max_frame, 65536),
    {ok, _} = application:ensure_all_started(actor_pool),
    N = actor_pool:pool_node(),
    Rows = [{"short ask timeout after idle (ms)", short_timeouts(N, env_int("BENCH_WAKE_TIMEOUTS", 9)), [],
             {lt_abs, 20, "< 20 ms"}},
            {"answer after an await (ms)", after_awaits(N, env_int("BENCH_WAKE_AWAITS", 21)), [],
             {lt_abs, 10, "< 10 ms"}},
            {"huge term refused, scheduler gap (ms)", huge_gap(), [], {lt_abs, 50, "< 50 ms"}}],
    ap_bench_util:print(Rows).

stop_pools() ->
    _ = [actor_pool:stop_pool(P) || P <- [wake_sleeper, wake_echo, wake_huge]],
    ok.

stop_app() ->
    ok = application:stop(actor_pool).

%% ===================================================================
%% Timeouts while the reply thread sleeps
%% ===================================================================

short_timeouts(N, Count) ->
    with_seg(N, wake_sleeper, {plugin, ap_support:test_bin("plugin_crash.so")}, fun(Seg) ->
        %% The one worker sleeps: what follows is not answered in time.
        _ = submit(Seg, wake_sleeper, {sleep, 60000}, make_ref()),
        Us = [begin
                  receive after 60 -> ok end,
                  Ref = make_ref(),
                  T0 = erlang:monotonic_time(microsecond),
                  _ = submit(Seg, wake_sleeper, {sleep, 1}, {Ref, 2}),
                  receive
                      {Ref, {error, timeout}} -> ok;
                      {Ref, Other} -> fail("a 2 ms ask was answered ~p", [Other])
                  after ?T -> fail("a 2 ms ask never timed out", [])
                  end,
                  erlang:monotonic_time(microsecond) - T0
              end || _ <- lists:seq(1, Count)],
        io:format("short ask timeouts after idle (us): ~w~n", [Us]),
        median(Us) / 1000
    end).

%% ===================================================================
%% Answers after an await
%% ===================================================================

after_awaits(N, Count) ->
    with_seg(N, wake_echo, echo, fun(Seg) ->
        Us = [begin
                  awaited(Seg, K, erlang:monotonic_time(millisecond) + ?T),
                  Ref = make_ref(),
                  T0 = erlang:monotonic_time(microsecond),
                  _ = submit(Seg, wake_echo, K, Ref),
                  receive {Ref, {ok, K}} -> ok after ?T -> fail("no answer to ask ~p", [K]) end,
                  erlang:monotonic_time(microsecond) - T0
              end || K <- lists:seq(1, Count)],
        io:format("answers after an await (us): ~w~n", [Us]),
        median(Us) / 1000
    end).

%% Lone asks, each awaited as long as await/3 waits, until one's answer is
%% taken in the NIF (a lone ask's answer may come as a message instead).
awaited(Seg, K, Deadline) ->
    Ref = make_ref(),
    Id = submit(Seg, wake_echo, K, Ref),
    case actor_dp:await(Seg, Id, 1000) of
        {reply, {ok, K}} ->
            ok;
        {reply, Other} ->
            fail("awaited ask ~p answered ~p", [K, Other]);
        none ->
            receive {Ref, {ok, K}} -> ok after ?T -> fail("no answer to ask ~p", [K]) end,
            case erlang:monotonic_time(millisecond) < Deadline of
                true -> awaited(Seg, K, Deadline);
                false -> fail("no answer was awaited in ~p ms", [?T])
            end
    end.

%% ===================================================================
%% A huge term and the caller's scheduler
%% ===================================================================

huge_gap() ->
    {ok, _} = actor_pool:start_pool(wake_huge, echo, #{workers => 1}),
    {ok, <<"warm">>} = actor_pool:ask(wake_huge, <<"warm">>),
    %% A persistent term: no garbage collection of the caller copies it.
    Key = {?MODULE, huge},
    persistent_term:put(Key, lists:seq(1, 10000000)),
    try
        Gaps = [huge_try(Key) || _ <- lists:seq(1, 3)],
        io:format("scheduler gaps while a huge term is refused (us): ~w~n", [Gaps]),
        lists:min(Gaps) / 1000
    after
        _ = persistent_term:erase(Key),
        _ = actor_pool:stop_pool(wake_huge)
    end.

%% The huge ask and tell from a process bound to its scheduler beside a
%% ticker: the ticker's longest gap (us).
huge_try(Key) ->
    Self = self(),
    {Pid, MRef} =
        spawn_monitor(fun() ->
                          Sched = bind_scheduler(erlang:system_info(scheduler_id)),
                          Ticker = start_ticker(Sched),
                          Huge = persistent_term:get(Key),
                          Ask = actor_pool:ask(wake_huge, Huge, 30000),
                          Tell = actor_pool:tell(wake_huge, Huge),
                          Self ! {huge, self(), Ask, Tell, stop_ticker(Ticker)}
                      end),
    receive
        {huge, Pid, {error, {too_large, _, _}}, ok, GapUs} ->
            erlang:demonitor(MRef, [flush]),
            GapUs;
        {huge, Pid, Ask, Tell, _} ->
            fail("the huge ask got ~P and the tell ~P", [Ask, 6, Tell, 6]);
        {'DOWN', MRef, process, Pid, Why} ->
            fail("the huge caller died: ~P", [Why, 6])
    after 120000 ->
            fail("the huge ask took over 120 s", [])
    end.

bind_scheduler(S) ->
    _ = process_flag(scheduler, S),
    ap_bench_util:wait_until(fun() -> erlang:yield(), erlang:system_info(scheduler_id) =:= S end, ?T,
                             bound_to_scheduler),
    S.

%% A process bound to scheduler S that runs whenever it can get it:
%% stop_ticker/1 gives the longest time (us) it went without running.
start_ticker(S) ->
    Self = self(),
    Pid = spawn_link(fun() ->
                             _ = bind_scheduler(S),
                             Self ! {ticking, self()},
                             tick(erlang:monotonic_time(microsecond), 0)
                     end),
    receive {ticking, Pid} -> Pid after ?T -> fail("the ticker did not start", []) end.

tick(Last, Max0) ->
    Now = erlang:monotonic_time(microsecond),
    Max = max(Max0, Now - Last),
    receive
        {stop, From} -> From ! {gap, self(), Max}
    after 0 ->
            erlang:yield(),
            tick(Now, Max)
    end.

stop_ticker(Pid) ->
    Pid ! {stop, self()},
    receive {gap, Pid, Max} -> Max after ?T -> fail("the ticker did not stop", []) end.

%% ===================================================================
%% The NIF, on a segment of this bench's own
%% ===================================================================

%% Fun(Seg) with a pool Name of one worker running Handler and a segment of
%% its own to node N; both closed after.
with_seg(N, Name, Handler, Fun) ->
    {ok, _} = actor_pool:start_pool(Name, Handler, #{workers => 1}),
    Seg = open(N),
    try
        Fun(Seg)
    after
        ok = actor_dp:close(Seg, done),
        _ = actor_pool:stop_pool(Name)
    end.

open(N) ->
    {ok, #{socket := Sock, token := Token}} = gen_server:call({actor_pool_node, N}, dp_info),
    {ok, Seg} = actor_dp:open(Sock, Token, #{node => N}),
    Seg.

%% An ask's submit: its id (the await mark, if any, dropped).
submit(Seg, Dest, Msg, RefOrTimed) ->
    case actor_dp:submit(Seg, ask, Dest, Msg, RefOrTimed, undefined) of
        {ok, _, Id, await} -> Id;
        {ok, _, Id} -> Id;
        Other -> fail("submit to ~p: ~p", [Dest, Other])
    end.
