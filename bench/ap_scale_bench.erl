%% @doc Scale benchmark of the receptionist on real nodes (issue 18):
%% ap_cluster_bench's cluster (BEAM peers on this host, each running the
%% actor_pool application with its own receptionist C node and no pool
%% node, a full mesh of exactly the members, a `pg' scope on each), started
%% afresh for every N in BENCH_SCALE_NODES, and per N:
%% <ul>
%% <li>convergence of a registration, p50 and p99: ap_cluster_bench's
%%     method (a driver on node 1 registers fresh refs one at a time; a
%%     subscriber per key on every other node notes when the listing holds
%%     the ref; latency: the last node's note minus the driver's time before
%%     `register/2'), beside `pg' (join on node 1, a `pg:monitor/2' watcher
%%     per group on every other node), in alternating batches;</li>
%% <li>gossip bytes per change: the `sent_bytes' gossip counter of
%%     `actor_receptionist:status()' on every member, summed, around each
%%     registration batch, divided by the changes (the periodic rounds sent
%%     meanwhile included; the `net' row subtracts the idle rate over the
%%     batches' wall time). Anchor: pg's `{join, ...}' message times N-1;</li>
%% <li>idle gossip: bytes and messages sent per member per second over a
%%     window of BENCH_SCALE_IDLE_S with no change (after one gossip
%%     interval of settling; the members' versions must not move), and the
%%     CPU each member's BEAM and C node used meanwhile (ms per s). pg sends
%%     nothing when idle;</li>
%% <li>CPU per change per node: the CPU time of every member's BEAM and
%%     receptionist C node (read by this node from /proc: each thread's
%%     schedstat run time, ns, summed; /proc/PID/stat's 10 ms ticks where
%%     the kernel keeps no schedstat; ap_cluster_bench:cpu_ms/1) over the
%%     registration batches, divided by the changes, mean over the members
%%     (the driver's node 1 included). The idle rounds meanwhile are
%%     included; the `idle rounds subtracted' row takes the idle rate
%%     (BEAM + C node) times the batches' wall time off. Anchor: the BEAMs'
%%     CPU over the pg batches, per join (the same idle rate off in the
%%     subtracted row: the receptionist's rounds go on during them);</li>
%% <li>removal: the last member registers BENCH_SCALE_REMOVAL_KEYS keys
%%     [10000] and, once every other member holds them, halts; time from
%%     just before the halt until the last survivor's `stats()' `refs' is
%%     back (and until 100 sampled keys read `[]' through `lookup/1' on
%%     every survivor), the survivors polling every BENCH_SCALE_POLL_MS.
%%     Anchor: a fresh peer joins as many pg groups and halts (ETS size of
%%     the scope back on every survivor).</li>
%% </ul>
%% A size whose peers would not fit in the free memory (MemAvailable, at
%% the larger of BENCH_SCALE_MB_PER_MEMBER and 1.5x the RSS measured per
%% member at the sizes before) is skipped, and the run says so.
%%
%% What the numbers mean on a small host: all N BEAMs, N C nodes and this
%% node share the host's CPUs (2 vCPUs on the development machine), so past
%% 2 or 3 members the peers queue for a CPU and convergence measures the
%% host's scheduling as much as the protocol; the peers run one scheduler
%% each (+S 1, one dirty CPU and IO scheduler, one async thread, no busy
%% wait) so that 20 of them do not spin against each other. pg runs on the
%% same peers, in batches alternating with the receptionist's, so it pays
%% the same; the ratios are the comparison to read, the absolute times an
%% upper bound. Gossip bytes do not depend on the host; CPU per change
%% includes the scheduling overhead of an overloaded host.
%%
%% Output: a table per N (the receptionist beside pg, ratio) and the rows
%% in _build/bench/scale.csv (n,measure,value,anchor,anchor_value,unit),
%% which bench/scale_report draws as curves vs N. Goal printed (issue 18):
%% convergence p99 < 5 ms at N >= 20.
%%
%% Knobs (environment, defaults in brackets): BENCH_SCALE_NODES ["3 5 10
%% 20"], BENCH_SCALE_CHANGES [1000] and BENCH_SCALE_BATCHES [10] (per N
%% and kind), BENCH_SCALE_REMOVAL_KEYS [10000], BENCH_SCALE_IDLE_S [5],
%% BENCH_SCALE_GOSSIP_MS (the members' `gossip_interval_ms'; the
%% application's default when unset), BENCH_SCALE_POLL_MS [ceil(N / 5)],
%% BENCH_SCALE_MB_PER_MEMBER [150], BENCH_SCALE_PEER_ARGS (the peers' extra
%% `erl' arguments, replacing the default "+S 1:1 +SDcpu 1:1 +SDio 1 +A 1
%% +sbwt none +sbwtdcpu none +sbwtdio none"), BENCH_SCALE_TIMEOUT_S [1500],
%% BENCH_STRICT=1 (exit 2 when the goal is missed).
%%
%% Every peer (and its C node) is stopped by pid after each size, also on
%% failure; the bench checks that their names left epmd, their OS
%% processes are gone and their snapshot segments left /dev/shm.
-module(ap_scale_bench).

-import(ap_bench_util, [env_int/2, ratio/2]).

-export([main/0]).

-define(CSV_FILE, "_build/bench/scale.csv").
-define(DEFAULT_PEER_ARGS,
        "+S 1:1 +SDcpu 1:1 +SDio 1 +A 1 +sbwt none +sbwtdcpu none +sbwtdio none").
%% The goal of issue 18 for the real cluster.
-define(GOAL_P99_US, 5000).
-define(GOAL_MIN_N, 20).

-spec main() -> no_return().
main() ->
    ap_bench_util:main("scale", "BENCH_SCALE_TIMEOUT_S", 1500, fun run/0,
                       [{"stopping the peers", fun ap_cluster_bench:stop_peers/0}]).

fail(Fmt, Args) -> throw({bench_failed, Fmt, Args}).

run() ->
    Sizes = [list_to_integer(S) || S <- string:lexemes(os:getenv("BENCH_SCALE_NODES", "3 5 10 20"), " ,")],
    [fail("BENCH_SCALE_NODES: ~p is not a size (3 or more members)", [N]) || N <- Sizes, N < 3],
    Cfg = #{name => atom_to_list(?MODULE),
            changes => env_int("BENCH_SCALE_CHANGES", 1000),
            batches => env_int("BENCH_SCALE_BATCHES", 10),
            rm_keys => env_int("BENCH_SCALE_REMOVAL_KEYS", 10000),
            idle_ms => 1000 * env_int("BENCH_SCALE_IDLE_S", 5),
            gossip_ms => env_int("BENCH_SCALE_GOSSIP_MS", undefined),
            poll_ms => env_int("BENCH_SCALE_POLL_MS", undefined),
            mb_per_member => env_int("BENCH_SCALE_MB_PER_MEMBER", 150),
            peer_args => string:lexemes(os:getenv("BENCH_SCALE_PEER_ARGS", ?DEFAULT_PEER_ARGS), " ")},
    #{changes := Changes, batches := Batches} = Cfg,
    Changes rem Batches =:= 0 orelse
        fail("BENCH_SCALE_CHANGES (~p) is not a multiple of BENCH_SCALE_BATCHES (~p)", [Changes, Batches]),
    is_alive() orelse fail("the bench node is not distributed (run it with -sname)", []),
    T0 = erlang:monotonic_time(millisecond),
    ok = filelib:ensure_dir(?CSV_FILE),
    ok = file:write_file(?CSV_FILE, "n,measure,value,anchor,anchor_value,unit\n"),
    io:format("~n== scale benchmark: N in ~w, ~p changes per kind in ~p batches, removal of ~p "
              "registrations, ~p CPUs on the host, peer args \"~ts\"~n",
              [Sizes, Changes, Batches, maps:get(rm_keys, Cfg),
               erlang:system_info(logical_processors_online), lists:join(" ", maps:get(peer_args, Cfg))]),
    {Missed, _} = lists:foldl(fun(N, {M, MbSeen}) ->
                                      case one_size(N, Cfg, MbSeen) of
                                          {skipped, _} -> {M, MbSeen};
                                          {ok, Miss, Mb} -> {M + Miss, max(Mb, MbSeen)}
                                      end
                              end, {0, 0}, Sizes),
    io:format("~nrows in ~s; scale bench took ~.1f s~n",
              [?CSV_FILE, (erlang:monotonic_time(millisecond) - T0) / 1000]),
    Missed.

%% ===================================================================
%% One size
%% ===================================================================

one_size(N, #{mb_per_member := Est} = Cfg0, MbSeen) ->
    %% N members and the pg anchor's extra peer of the removal.
    PerMember = max(Est, round(1.5 * MbSeen)),
    Need = (N + 1) * PerMember,
    Avail = mem_available_mb(),
    case Need > 0.8 * Avail of
        true ->
            io:format("~n== N=~p skipped: ~p peers at ~p MB each need ~p MB, ~p MB of memory "
                      "available (80% usable)~n", [N, N + 1, PerMember, Need, Avail]),
            {skipped, memory};
        false ->
            Cfg = Cfg0#{poll_ms => case maps:get(poll_ms, Cfg0) of
                                       undefined -> (N + 4) div 5;
                                       P -> P
                                   end},
            T0 = erlang:monotonic_time(millisecond),
            Nodes = ap_cluster_bench:start_cluster(N, Cfg),
            TUp = erlang:monotonic_time(millisecond),
            Interval = erpc:call(hd(Nodes), application, get_env, [actor_pool, gossip_interval_ms, 1000]),
            Conv = ap_cluster_bench:convergence(Nodes, Cfg),
            Mb = rss_mb(Nodes),
            Idle = idle(Nodes, Interval, Cfg),
            Gone = lists:last(Nodes),
            Rm = ap_cluster_bench:removal(Nodes -- [Gone], Gone, Cfg),
            ok = ap_cluster_bench:stop_peers(),
            Rows = rows(N, Conv, Idle, Rm, Mb, Cfg),
            io:format("~n== N=~p (gossip_interval_ms ~p, ~p MB RSS per member, started and meshed "
                      "in ~.1f s, size done in ~.1f s, removal polled every ~p ms)~n",
                      [N, Interval, round(Mb), (TUp - T0) / 1000,
                       (erlang:monotonic_time(millisecond) - T0) / 1000, maps:get(poll_ms, Cfg)]),
            Missed = print(Rows),
            Cpu = cpu_of(rcpt, Conv),
            io:format("CPU over the registration batches (ms), BEAM + C node, members 1..~p: ~ts~n",
                      [N, lists:join(" ", [io_lib:format("~b+~b", [round(B), round(C)])
                                           || Node <- Nodes, {B, C} <- [maps:get(Node, Cpu)]])]),
            ok = write_csv(N, Rows),
            {ok, Missed, Mb}
    end.

%% Gossip with no change: one interval to settle (the last change's
%% rounds), then a window of idle_ms (at least 3 intervals).
idle(Nodes, Interval, #{idle_ms := IdleMs}) ->
    Window = max(IdleMs, 3 * Interval),
    receive after Interval -> ok end,
    V0 = versions(Nodes),
    G0 = ap_cluster_bench:gossip_counters(Nodes),
    C0 = ap_cluster_bench:cpu(Nodes),
    T0 = erlang:monotonic_time(microsecond),
    %% The measurement is a span of time with nothing happening: sleeping
    %% through it is the method, not a synchronisation.
    receive after Window -> ok end,
    T1 = erlang:monotonic_time(microsecond),
    C1 = ap_cluster_bench:cpu(Nodes),
    G1 = ap_cluster_bench:gossip_counters(Nodes),
    V0 =:= versions(Nodes) orelse fail("a registration changed during the idle window", []),
    S = (T1 - T0) / 1.0e6,
    N = length(Nodes),
    Cpu = [{B1 - B0, X1 - X0} || {Node, {B1, X1}} <- maps:to_list(C1), {B0, X0} <- [maps:get(Node, C0)]],
    #{bytes_per_member_s => (maps:get(sent_bytes, G1) - maps:get(sent_bytes, G0)) / N / S,
      msgs_per_member_s => (maps:get(sent, G1) - maps:get(sent, G0)) / N / S,
      beam_ms_per_s => mean([B || {B, _} <- Cpu]) / S,
      cnode_ms_per_s => mean([C || {_, C} <- Cpu]) / S,
      window_s => S}.

versions(Nodes) ->
    [{N, maps:get(origins, erpc:call(N, actor_receptionist, status, []))} || N <- Nodes].

%% Resident memory of each member's BEAM and C node, mean, MB.
rss_mb(Nodes) ->
    Pids = [P || {{peer, _}, #{node := N} = P} <- get(), lists:member(N, Nodes)],
    mean([(rss_kb(B) + rss_kb(C)) / 1024 || #{beam_os_pid := B, cnode_os_pid := C} <- Pids]).

rss_kb(OsPid) ->
    kb_field("/proc/" ++ integer_to_list(OsPid) ++ "/status", "VmRSS:").

mem_available_mb() ->
    kb_field("/proc/meminfo", "MemAvailable:") div 1024.

kb_field(File, Field) ->
    {ok, B} = file:read_file(File),
    case [L || L <- string:split(binary_to_list(B), "\n", all), lists:prefix(Field, L)] of
        [L | _] -> list_to_integer(hd(string:lexemes(lists:nthtail(length(Field), L), " \t")));
        [] -> fail("no ~s in ~s", [Field, File])
    end.

mean([]) -> 0;
mean(L) -> lists:sum(L) / length(L).

cpu_of(Kind, #{cost := Cost}) ->
    maps:get(cpu, maps:get(Kind, Cost)).

%% ===================================================================
%% Rows
%% ===================================================================

%% {Measure, Label, Value, Anchor, AnchorValue, Unit, Target}; Anchor ""
%% (and AnchorValue undefined) when there is none.
rows(N, Conv, Idle, #{rcpt := RR, pg := RP, nodes := Survivors}, Mb, #{changes := C}) ->
    #{rcpt := R, pg := P, bytes := Bytes, pg_bytes := PgBytes, cost := #{rcpt := RCost, pg := PCost}} = Conv,
    %% The idle rounds sent during the registration batches.
    IdleBytes = maps:get(bytes_per_member_s, Idle) * N * maps:get(us, RCost) / 1.0e6,
    PerChange = fun(Kind, Which) ->
                        mean([element(Which, V) / C || V <- maps:values(cpu_of(Kind, Conv))])
                end,
    %% Less what the idle rounds cost over the batches' wall time (the
    %% receptionist's rounds go on during the pg batches too).
    IdleCpu = maps:get(beam_ms_per_s, Idle) + maps:get(cnode_ms_per_s, Idle),
    Net = fun(Kind, Cost, PerS) -> PerChange(Kind, 1) + PerChange(Kind, 2) - PerS * maps:get(us, Cost) / 1.0e6 / C end,
    Goal = case N >= ?GOAL_MIN_N of
               true -> {lt_abs, ?GOAL_P99_US, "< 5 ms (issue 18)"};
               false -> none
           end,
    Gone = fun(Run, What) -> worst(Run, What, Survivors) end,
    CpuRm = fun(Run, What) ->
                    mean([maps:get(What, proplists:get_value(S, maps:get(cpu, Run))) || S <- Survivors])
            end,
    Load = fun(Run) -> lists:max([proplists:get_value(S, maps:get(load, Run)) || S <- Survivors]) / 1000 end,
    [{conv_p50, "convergence p50", maps:get(p50, R), "pg", maps:get(p50, P), "us", none},
     {conv_p99, "convergence p99", maps:get(p99, R), "pg", maps:get(p99, P), "us", Goal},
     {gossip_bytes_per_change, "gossip bytes per change", Bytes,
      "pg join msg x (N-1)", PgBytes, "bytes", none},
     {gossip_bytes_per_change_net, "  idle rounds subtracted", (maps:get(bytes, RCost) - IdleBytes) / C,
      "pg join msg x (N-1)", PgBytes, "bytes", none},
     {idle_gossip_bytes_per_member_s, "idle gossip per member", maps:get(bytes_per_member_s, Idle),
      "pg", 0, "bytes/s", none},
     {idle_gossip_msgs_per_member_s, "idle gossip msgs per member", maps:get(msgs_per_member_s, Idle),
      "pg", 0, "msgs/s", none},
     {idle_cpu_beam_ms_per_s, "idle CPU per member, BEAM", maps:get(beam_ms_per_s, Idle), "", undefined,
      "ms/s", none},
     {idle_cpu_cnode_ms_per_s, "idle CPU per member, C node", maps:get(cnode_ms_per_s, Idle), "", undefined,
      "ms/s", none},
     {cpu_beam_per_change_ms, "CPU per change per node, BEAM", PerChange(rcpt, 1), "pg",
      PerChange(pg, 1), "ms", none},
     {cpu_cnode_per_change_ms, "CPU per change per node, C node", PerChange(rcpt, 2), "", undefined,
      "ms", none},
     {cpu_total_per_change_ms, "CPU per change per node, both", PerChange(rcpt, 1) + PerChange(rcpt, 2),
      "pg", PerChange(pg, 1), "ms", none},
     {cpu_net_per_change_ms, "  idle rounds subtracted", Net(rcpt, RCost, IdleCpu),
      "pg", Net(pg, PCost, IdleCpu), "ms", none},
     {removal_ms, "removal, last survivor's refs back", Gone(RR, gone), "pg", Gone(RP, gone), "ms", none},
     {removal_lookup_ms, "removal, 100 keys [] everywhere", Gone(RR, lookup), "", undefined, "ms", none},
     {removal_nodedown_ms, "removal, nodedown everywhere", Gone(RR, down), "pg", Gone(RP, down), "ms", none},
     {removal_cpu_beam_ms, "removal CPU per survivor, BEAM", CpuRm(RR, beam_cpu), "pg",
      CpuRm(RP, beam_cpu), "ms", none},
     {removal_cpu_cnode_ms, "removal CPU per survivor, C node", CpuRm(RR, cnode_cpu), "", undefined,
      "ms", none},
     {load_ms, "registrations reach every member", Load(RR), "pg", Load(RP), "ms", none},
     {rss_per_member_mb, "RSS per member (BEAM + C node)", Mb, "", undefined, "MB", none}].

%% The latest of the survivors' times for What, ms from the halt.
worst(Run, What, Survivors) ->
    Ts = [maps:get(What, proplists:get_value(S, maps:get(gone, Run)), undefined) || S <- Survivors],
    case [T || T <- Ts, T =/= undefined] of
        [] -> undefined;
        Defined -> lists:max(Defined) / 1000
    end.

print(Rows) ->
    io:format("~-36s ~11s ~11s ~7s  ~-7s ~s~n", ["measure", "actor_pool", "anchor", "ratio", "unit", "anchor / goal"]),
    lists:foldl(fun({_, Label, V, A, AV, Unit, Target}, Missed) ->
                        {Verdict, M} = verdict(V, Target),
                        io:format("~-36s ~11s ~11s ~7s  ~-7s ~s~s~n",
                                  [Label, fmt(V), fmt(AV), ratio(V, AV), Unit, A,
                                   case Verdict of "" -> ""; _ -> "; " ++ Verdict end]),
                        Missed + M
                end, 0, Rows).

verdict(_, none) -> {"", 0};
verdict(V, {lt_abs, Max, Text}) when is_number(V), V < Max -> {Text ++ " met", 0};
verdict(_, {lt_abs, _, Text}) -> {Text ++ " MISSED", 1}.

write_csv(N, Rows) ->
    Lines = [[integer_to_list(N), $,, atom_to_list(M), $,, num(V), $,, A, $,, num(AV), $,, U, $\n]
             || {M, _, V, A, AV, U, _} <- Rows, is_number(V)],
    file:write_file(?CSV_FILE, Lines, [append]).

%% Three significant digits for the small ones (CPU per change).
fmt(V) when is_float(V), V < 10 -> io_lib:format("~.3f", [V]);
fmt(V) -> ap_bench_util:fmt(V).

num(undefined) -> "";
num(V) when is_integer(V) -> integer_to_list(V);
num(V) when is_float(V) -> float_to_list(V, [{decimals, 4}, compact]).
