%% @doc Runtime benchmark (issue 2): the echo C node against the same echo
%% service on a plain BEAM peer node, measured in one run and printed side by
%% side with the ratios and the targets. Run it with `make bench'.
%%
%% Each cell is the median of ?RUNS runs. Tells are counted by the receiver
%% (its `stats' call), so a message lost or still queued is not counted as
%% delivered. CPU per message is the receiving OS process's user+system time
%% over the run (getrusage in the C node, statistics(runtime) in the peer).
-module(ap_bench).

-export([main/0, main/1]).

-define(RUNS, 3).
-define(PAYLOAD, <<0:800>>).

-spec main() -> no_return().
main() -> main([]).

-spec main([string()]) -> no_return().
main(_Args) ->
    Code = try run() of
               ok -> 0
           catch C:R:St ->
               io:format("bench failed: ~p:~p~n~p~n", [C, R, St]), 1
           end,
    halt(Code).

run() ->
    {ok, _} = application:ensure_all_started(actor_pool),
    Tells = env_int("BENCH_TELLS", 400000),
    Asks = env_int("BENCH_ASKS", 20000),
    {ok, Owner} = actor_cnode:start(#{exe => ap_support:test_bin("actor_echo_node")}),
    CNode = actor_cnode:node(Owner),
    Io = maps:get(io, actor_cnode:info(Owner)),
    {ok, Peer, PeerNode} = start_peer(),
    try
        C = target(cnode, CNode),
        P = target(peer, PeerNode),
        io:format("~nactor_pool runtime benchmark: echo C node (io ~p) vs BEAM peer node~n", [Io]),
        io:format("~p tells per run, ~p asks per run, median of ~p runs, payload ~p bytes~n~n",
                  [Tells, Asks, ?RUNS, byte_size(?PAYLOAD)]),
        Rows = [
            {"tell, 1 sender (msg/s)", fun(T) -> tell(T, 1, Tells, 1) end, higher, "ratio >= 1.0"},
            {"tell, 8 senders (msg/s)", fun(T) -> tell(T, 8, Tells, 1) end, higher, "ratio >= 1.0"},
            {"tell, 1 sender, batch 64 (msg/s)", fun(T) -> tell(T, 1, Tells * 4, 64) end, higher, ">= 2.0M"},
            {"tell, 8 senders, batch 64 (msg/s)", fun(T) -> tell(T, 8, Tells * 4, 64) end, higher, ">= 2.0M"},
            {"ask p50 (us)", fun(T) -> ask_latency(T, Asks, 50) end, lower, "ratio <= 0.7"},
            {"ask p99 (us)", fun(T) -> ask_latency(T, Asks, 99) end, lower, ""},
            {"ask, 64 callers (asks/s)", fun(T) -> ask_parallel(T, 64, Asks * 2) end, higher, ""},
            {"receiver CPU per tell (us)", fun(T) -> cpu_per_tell(T, Tells) end, lower, "C node <= 0.3"},
            {"receiver CPU per tell, batch 64 (us)", fun(T) -> cpu_per_tell_batched(T, Tells * 4) end, lower, ""}
        ],
        io:format("~-38s ~14s ~14s ~8s  ~s~n", ["measure", "C node", "BEAM peer", "ratio", "target"]),
        io:format("~s~n", [lists:duplicate(90, $-)]),
        lists:foreach(
          fun({Name, F, _Better, Target}) ->
                  Cv = median([F(C) || _ <- lists:seq(1, ?RUNS)]),
                  Pv = median([F(P) || _ <- lists:seq(1, ?RUNS)]),
                  io:format("~-38s ~14s ~14s ~8s  ~s~n",
                            [Name, fmt(Cv), fmt(Pv), fmt_ratio(Cv, Pv), Target]),
                  ap_bench_csv:row("runtime", Name, Cv, [{"BEAM peer node", Pv}], Target, none)
          end, Rows),
        io:format("~n"),
        ok
    after
        peer:stop(Peer),
        actor_cnode:stop(Owner)
    end.

%% ---- targets ---------------------------------------------------------------

target(Kind, Node) ->
    Pid = gen_server:call({echo, Node}, pid, 10000),
    #{kind => Kind, node => Node, pid => Pid}.

start_peer() ->
    Name = list_to_atom("ap_bench_peer_" ++ os:getpid()),
    BenchDir = filename:dirname(code:which(?MODULE)),
    {ok, Peer, Node} = peer:start_link(#{name => Name, args => ["-pa", BenchDir]}),
    {ok, _} = erpc:call(Node, ap_bench_echo, start, []),
    %% The echo gen_server must outlive the peer:call process.
    {ok, Peer, Node}.

stats(#{pid := Pid}) -> gen_server:call(Pid, stats, 60000).

tells_seen(T) -> maps:get(tells, stats(T)).

cpu_us(#{kind := cnode} = T) ->
    S = stats(T), maps:get(utime_us, S) + maps:get(stime_us, S);
cpu_us(#{kind := peer} = T) ->
    maps:get(cpu_us, stats(T)).

%% ---- measures --------------------------------------------------------------

%% Send Total messages from Senders processes (as Total div Batch messages
%% of Batch each when Batch > 1); the clock stops when the receiver has
%% counted them all.
tell(T, Senders, Total, Batch) ->
    {Us, _} = timed_tells(T, Senders, Total, Batch),
    Total / (Us / 1.0e6).

timed_tells(#{pid := Pid} = T, Senders, Total, Batch) ->
    Base = tells_seen(T),
    PerSender = Total div Senders,
    Msg = case Batch of
              1 -> ?PAYLOAD;
              _ -> {batch, lists:duplicate(Batch, ?PAYLOAD)}
          end,
    Sends = PerSender div Batch,
    Self = self(),
    T0 = erlang:monotonic_time(microsecond),
    Ps = [spawn_link(fun() -> send_n(Pid, Msg, Sends), Self ! {sent, self()} end)
          || _ <- lists:seq(1, Senders)],
    [receive {sent, P} -> ok end || P <- Ps],
    Expected = Base + Senders * Sends * Batch,
    wait_count(T, Expected, erlang:monotonic_time(millisecond) + 120000),
    T1 = erlang:monotonic_time(microsecond),
    {T1 - T0, Senders * Sends * Batch}.

send_n(_Pid, _Msg, 0) -> ok;
send_n(Pid, Msg, N) -> Pid ! Msg, send_n(Pid, Msg, N - 1).

wait_count(T, Expected, Deadline) ->
    case tells_seen(T) of
        N when N >= Expected -> ok;
        N ->
            erlang:monotonic_time(millisecond) < Deadline orelse
                error({tells_lost, Expected - N}),
            wait_count(T, Expected, Deadline)
    end.

ask_latency(#{pid := Pid}, N, Pct) ->
    Req = {ask, ?PAYLOAD},
    [gen_server:call(Pid, Req) || _ <- lists:seq(1, 1000)], % warm up
    Ts = lists:sort([begin
                         T0 = erlang:monotonic_time(nanosecond),
                         Req = gen_server:call(Pid, Req),
                         erlang:monotonic_time(nanosecond) - T0
                     end || _ <- lists:seq(1, N)]),
    lists:nth(max(1, (N * Pct) div 100), Ts) / 1000.

ask_parallel(#{pid := Pid}, Callers, Total) ->
    Per = Total div Callers,
    Req = {ask, ?PAYLOAD},
    Self = self(),
    T0 = erlang:monotonic_time(microsecond),
    Ps = [spawn_link(fun() -> [Req = gen_server:call(Pid, Req) || _ <- lists:seq(1, Per)],
                              Self ! {done, self()} end) || _ <- lists:seq(1, Callers)],
    [receive {done, P} -> ok end || P <- Ps],
    Us = erlang:monotonic_time(microsecond) - T0,
    Callers * Per / (Us / 1.0e6).

cpu_per_tell(T, Total) ->
    C0 = cpu_us(T),
    {_, N} = timed_tells(T, 1, Total, 1),
    (cpu_us(T) - C0) / N.

cpu_per_tell_batched(T, Total) ->
    C0 = cpu_us(T),
    {_, N} = timed_tells(T, 1, Total, 64),
    (cpu_us(T) - C0) / N.

%% ---- output ----------------------------------------------------------------

median(L) -> lists:nth((length(L) + 1) div 2, lists:sort(L)).

fmt(V) when V >= 1.0e6 -> io_lib:format("~.2fM", [V / 1.0e6]);
fmt(V) when V >= 1.0e4 -> io_lib:format("~.1fK", [V / 1.0e3]);
fmt(V) when V >= 100 -> integer_to_list(round(V));
fmt(V) -> io_lib:format("~.3f", [float(V)]).

fmt_ratio(_, P) when P == 0 -> "-";
fmt_ratio(C, P) -> io_lib:format("~.2f", [C / P]).

env_int(Name, Default) ->
    case os:getenv(Name) of
        false -> Default;
        S -> list_to_integer(S)
    end.
