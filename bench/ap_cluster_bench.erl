%% @doc Cluster benchmark of the receptionist: BEAM peers on this
%% host (the `peer' module), each running the actor_pool application with
%% its own receptionist C node (no pool node), connected pairwise by
%% distributed Erlang. The bench node itself runs no actor_pool; it starts
%% the peers and drives them by `erpc'. In one run:
%% <ul>
%% <li>convergence, for N = 3 and N = 5 members: BENCH_CLUSTER_CHANGES
%%     [1000] registrations, one at a time, each of a fresh ref (an idle
%%     process on node 1) under its own key, by a driver process on node 1;
%%     every other node has one local subscriber per key, which notes
%%     `os:system_time(microsecond)' when a `{listing, Key, Refs}' with the
%%     new ref arrives. Latency of a change: the last node's note minus the
%%     driver's time just before `actor_receptionist:register/2' (the peers
%%     share the host's clock). p50 and p99 (and, below the table, the p50
%%     per receiving node). Anchor, same shape: `pg' (one
%%     scope on every node; `pg:join/3' on node 1, a `pg:monitor/2' watcher
%%     per group on every other node, noting the `join' notice, which pg
%%     sends right after its ETS shows the member). The two kinds run in
%%     alternating batches (BENCH_CLUSTER_BATCHES [10] of each), so host
%%     noise hits both alike;</li>
%% <li>gossip bytes per change: the `sent_bytes' gossip counter in every
%%     member's `actor_receptionist:status()' (external size of every gossip
%%     message it sent) around each receptionist batch, summed over the members, divided by
%%     the changes (periodic digests sent meanwhile included). Anchor: the
%%     external size of the `{join, ScopePid, Group, Pid}' message pg sends
%%     to each other scope per join (kernel's pg.erl), times N-1;</li>
%% <li>removal, N = 3: node 2 registers BENCH_CLUSTER_REMOVAL_KEYS [100000]
%%     keys (one ref each, 100 idle processes on node 2) as fast as it can;
%%     once node 1 and node 3 hold them all (their C nodes' `refs' stat),
%%     node 2 halts (`erlang:halt/0' by `erpc:cast'). Time from just before
%%     the halt until a watcher on node 1 (and one on node 3) polling
%%     `actor_receptionist:stats()' every 1 ms sees `refs' back to what it
%%     was before the registrations (the target applies to both). The
%%     breakdown rows, from helper processes beside each watcher: when
%%     `nodedown' arrived; when the first and the last of 100 sampled keys
%%     read `[]' through `lookup/1' (the snapshot, polled every 1 ms); when
%%     the C node's own `refs' (asked directly, not behind the receptionist
%%     server) was back; and the CPU time (/proc, cpu_ms/1) the C node
%%     and the BEAM of that node used from `loaded' to done. Also printed:
%%     how long the K registrations took to reach nodes 1 and 3. Anchor: a
%%     fresh peer joins as many pg groups (1000 processes x 100 groups, as
%%     in ap_rcpt_bench) and halts; time until the scope's ETS table on
%%     node 1 (node 3) is back to its size before (what
%%     `pg:which_groups/1' reads).</li>
%% </ul>
%% Targets: convergence p99 < 50 ms and p50 <= 2x pg's p50 (N = 3 and
%% N = 5); removal of 100K registrations < 200 ms.
%%
%% Knobs (environment, defaults in brackets): BENCH_CLUSTER_CHANGES [1000],
%% BENCH_CLUSTER_BATCHES [10], BENCH_CLUSTER_REMOVAL_KEYS [100000],
%% BENCH_CLUSTER_GOSSIP_MS (the members' `gossip_interval_ms'; the
%% application's default when unset), BENCH_CLUSTER_PEER_ARGS (extra `erl'
%% arguments of the peers, e.g. "+sbwt none"), BENCH_CLUSTER_TIMEOUT_S
%% (the whole bench [240]), BENCH_STRICT=1 (exit 2 when a target is
%% missed). ACTOR_POOL_IO (set by bench/run) reaches the peers' C nodes
%% through the environment.
%%
%% Every peer is stopped at the end, also on failure, and the bench checks
%% that their names (BEAM and receptionist C node) left epmd and their OS
%% processes are gone. Exit status: 0; 1 when something failed (a timeout,
%% a wrong listing, a peer that does not start or does not go; the message
%% says what); 2 for a missed target under BENCH_STRICT=1.
-module(ap_cluster_bench).

-import(ap_bench_util, [env_int/2, median/1, wait_until/3, print/1, fmt/1, ratio/2]).

-export([main/0]).

%% Run on the peers (spawned there by name, or called by erpc).
-export([idle/0, spawn_idle/1, driver/0, subscribe_all/3, rcpt_sub/5, pg_sub/5,
         pg_join_size/1, pg_ready_join/0, register_many/2, join_many/3, watch/6, probe/1]).

%% The scale bench (ap_scale_bench) runs the same measures at more sizes.
-export([start_cluster/2, stop_peers/0, convergence/2, removal/3, gossip_counters/1, cpu/1,
         cpu_ms/1]).

-define(SCOPE, ap_cluster_bench_pg).
%% Any single wait: mesh, listings, a batch, a watcher phase.
-define(WAIT_MS, 30000).
%% A change not seen everywhere in this long fails the bench.
-define(SEEN_MS, 10000).
%% Loading the removal keys (registration plus replication).
-define(LOAD_MS, 120000).
%% Removal: the pg peer's member processes (K/1000 groups each), and the
%% idle processes on node 2 that are the refs of its K keys.
-define(PG_PROCS, 1000).
-define(RM_PROCS, 100).

-spec main() -> no_return().
main() ->
    %% The peers are linked to this node's control processes: they halt
    %% with it.
    ap_bench_util:main("cluster", "BENCH_CLUSTER_TIMEOUT_S", 240, fun run/0,
                       [{"stopping the peers", fun stop_peers/0}]).

fail(Fmt, Args) -> throw({bench_failed, Fmt, Args}).

run() ->
    Cfg = #{changes => env_int("BENCH_CLUSTER_CHANGES", 1000),
            batches => env_int("BENCH_CLUSTER_BATCHES", 10),
            rm_keys => env_int("BENCH_CLUSTER_REMOVAL_KEYS", 100000),
            gossip_ms => env_int("BENCH_CLUSTER_GOSSIP_MS", undefined),
            peer_args => string:lexemes(os:getenv("BENCH_CLUSTER_PEER_ARGS", ""), " ")},
    #{changes := Changes, batches := Batches} = Cfg,
    Changes rem Batches =:= 0 orelse
        fail("BENCH_CLUSTER_CHANGES (~p) is not a multiple of BENCH_CLUSTER_BATCHES (~p)",
             [Changes, Batches]),
    is_alive() orelse fail("the bench node is not distributed (run it with -sname)", []),
    code:ensure_loaded(pg) =:= {module, pg} andalso erlang:function_exported(pg, monitor, 2)
        orelse fail("pg:monitor/2 is missing (OTP 25.1 or later needed)", []),
    T0 = erlang:monotonic_time(millisecond),
    %% N = 3: convergence, then removal on the same members.
    Nodes3 = start_cluster(3, Cfg),
    Io = erpc:call(hd(Nodes3), actor_cnode, info, [actor_receptionist_owner]),
    io:format("~n== cluster benchmark (io ~p, ~p changes in ~p batches per kind, "
              "~p CPUs on the host, gossip_interval_ms ~p)~n",
              [maps:get(io, Io), Changes, Batches, erlang:system_info(logical_processors_online),
               erpc:call(hd(Nodes3), application, get_env, [actor_pool, gossip_interval_ms, 1000])]),
    Conv3 = convergence(Nodes3, Cfg),
    Rm = removal(Nodes3, Cfg),
    ok = stop_peers(),
    %% N = 5: convergence.
    Nodes5 = start_cluster(5, Cfg),
    Conv5 = convergence(Nodes5, Cfg),
    ok = stop_peers(),
    Rows = conv_rows(3, Conv3) ++ conv_rows(5, Conv5) ++ removal_rows(Rm, Cfg),
    Missed = print(Rows),
    [io:format("N=~p per-node convergence p50 (us), by node: ~0p~n", [N, PerNode])
     || {N, #{per_node := PerNode}} <- [{3, Conv3}, {5, Conv5}]],
    io:format("cluster bench took ~.1f s~n", [(erlang:monotonic_time(millisecond) - T0) / 1000]),
    Missed.

%% ===================================================================
%% Peers
%% ===================================================================

%% N members, connected pairwise, each a complete view, pg scopes in sync.
%% Cfg: changes, gossip_ms, peer_args as run/0 reads them; `name' (the
%% peers' name prefix, default this module's).
-spec start_cluster(pos_integer(), map()) -> [node()].
start_cluster(N, Cfg) ->
    Prefix = name(Cfg) ++ "_" ++ os:getpid() ++ "_" ++ integer_to_list(N) ++ "_",
    Nodes = [start_member(Prefix ++ integer_to_list(I), Cfg) || I <- lists:seq(1, N)],
    mesh(Nodes),
    Nodes.

start_peer(Name, Cfg) ->
    Paths = lists:usort([filename:absname(filename:dirname(code:which(M)))
                         || M <- [actor_receptionist, ?MODULE]]),
    Args = ["-setcookie", atom_to_list(erlang:get_cookie()),
            %% Their notices (C nodes up) would cut through the table.
            "-kernel", "logger_level", "warning",
            %% Only the connections made here: a mesh of exactly the members.
            "-connect_all", "false"
            | lists:append([["-pa", P] || P <- Paths])] ++ maps:get(peer_args, Cfg),
    {ok, Peer, Node} = case peer:start_link(#{name => Name, args => Args}) of
                           {ok, _, _} = Ok -> Ok;
                           Err -> fail("peer ~s did not start: ~p", [Name, Err])
                       end,
    OsPid = list_to_integer(erpc:call(Node, os, getpid, [])),
    put({peer, Peer}, #{node => Node, names => [Name], os_pids => [OsPid], beam_os_pid => OsPid}),
    {ok, _} = erpc:call(Node, pg, start, [?SCOPE]),
    {Peer, Node}.

start_member(Name, Cfg) ->
    {Peer, Node} = start_peer(Name, Cfg),
    Env = [{pool_node, false}, {receptionist_shm_mb, 64},
           %% one subscriber per key and kind on each node
           {max_subscribers_total, max(10000, 2 * maps:get(changes, Cfg))}]
        ++ [{gossip_interval_ms, G} || G <- [maps:get(gossip_ms, Cfg)], G =/= undefined],
    ok = erpc:call(Node, application, load, [actor_pool]),
    [ok = erpc:call(Node, application, set_env, [actor_pool, K, V]) || {K, V} <- Env],
    case erpc:call(Node, application, ensure_all_started, [actor_pool], ?WAIT_MS) of
        {ok, _} -> ok;
        Err -> fail("actor_pool did not start on ~p: ~p", [Node, Err])
    end,
    RNode = erpc:call(Node, actor_receptionist, receptionist_node, []),
    #{os_pid := COsPid} = erpc:call(Node, actor_cnode, info, [actor_receptionist_owner]),
    [RName, _] = string:split(atom_to_list(RNode), "@"),
    P = get({peer, Peer}),
    %% stop_peers/0 waits for its snapshot segment to leave /dev/shm too.
    put({peer, Peer}, P#{names := [Name, RName], os_pids := [COsPid | maps:get(os_pids, P)],
                         cnode_os_pid => COsPid,
                         segments => ["/dev/shm" ++ actor_cnode:shm_name(RNode)]}),
    Node.

name(Cfg) ->
    maps:get(name, Cfg, atom_to_list(?MODULE)).

%% Connect every pair; wait until every member's view is complete with
%% exactly the others, and every pg scope sees every other.
mesh(Nodes) ->
    [case erpc:call(A, net_kernel, connect_node, [B]) of
         true -> ok;
         R -> fail("~p could not connect to ~p: ~p", [A, B, R])
     end || A <- Nodes, B <- Nodes, A < B],
    [wait_until(fun() ->
                        case erpc:call(N, actor_receptionist, status, []) of
                            #{complete := true, members := M} -> M =:= lists:sort(Nodes -- [N]);
                            _ -> false
                        end
                end, ?WAIT_MS, {receptionist_view_complete, N})
     || N <- Nodes],
    pg_ready(Nodes).

%% Each node joins {ready, Node}; every node sees every such group.
pg_ready(Nodes) ->
    [ok = erpc:call(N, ?MODULE, pg_ready_join, []) || N <- Nodes],
    [wait_until(fun() ->
                        lists:all(fun(O) -> erpc:call(N, pg, get_members, [?SCOPE, {ready, O}]) =/= [] end,
                                  Nodes)
                end, ?WAIT_MS, {pg_scopes_in_sync, N})
     || N <- Nodes],
    ok.

pg_ready_join() ->
    ok = pg:join(?SCOPE, {ready, node()}, spawn(fun idle/0)).

%% Stops every peer started so far (by this process); their names must
%% leave epmd, their OS processes (BEAM and C node) must be gone and their
%% snapshot segments must have left /dev/shm.
-spec stop_peers() -> ok.
stop_peers() ->
    ap_bench_util:stop_peers(?WAIT_MS).

%% ===================================================================
%% Convergence
%% ===================================================================

%% Registrations (and pg joins) by node 1, seen on every other node: the
%% latencies' p50 and p99 per kind, and around each batch the gossip bytes
%% sent by all members, the CPU time of every member's BEAM and C node
%% (read here from /proc: the peers share the host) and the batches'
%% wall time, per kind.
-spec convergence([node()], map()) -> map().
convergence([N1 | Others] = Nodes, #{changes := C, batches := B}) ->
    Refs = erpc:call(N1, ?MODULE, spawn_idle, [C]),
    Pids = erpc:call(N1, ?MODULE, spawn_idle, [C]),
    Is = lists:seq(1, C),
    RItems = [{I, actor_receptionist:service_key(<<"conv-", (integer_to_binary(I))/binary>>), R}
              || {I, R} <- lists:zip(Is, Refs)],
    PItems = [{I, {conv, I}, P} || {I, P} <- lists:zip(Is, Pids)],
    Driver = erpc:call(N1, erlang, spawn, [?MODULE, driver, []]),
    [case erpc:call(N, ?MODULE, subscribe_all, [Driver, RItems, PItems], 2 * ?WAIT_MS) of
         ok -> ok;
         Err -> fail("subscribers on ~p: ~p", [N, Err])
     end || N <- Others],
    Chunks = lists:zip(chunks(RItems, C div B), chunks(PItems, C div B)),
    NO = length(Others),
    Zero = #{bytes => 0, us => 0, cpu => #{}},
    {RLat, PLat, RCost, PCost} =
        lists:foldl(
          fun({{RC, PC}, K}, {RAcc, PAcc, RCAcc, PCAcc}) ->
                  Run = fun(Kind, Items) ->
                                S0 = sample(Nodes),
                                L = run_batch(Driver, Kind, Items, NO),
                                {L, cost(S0, sample(Nodes))}
                        end,
                  %% Which kind goes first alternates too.
                  {{RL, RCo}, {PL, PCo}} = case K rem 2 of
                                               0 -> R = Run(rcpt, RC), {R, Run(pg, PC)};
                                               1 -> P = Run(pg, PC), {Run(rcpt, RC), P}
                                           end,
                  {RL ++ RAcc, PL ++ PAcc, add_cost(RCo, RCAcc), add_cost(PCo, PCAcc)}
          end, {[], [], Zero, Zero}, lists:zip(Chunks, lists:seq(1, length(Chunks)))),
    Driver ! stop,
    %% Every subscriber got the ref it waited for; lookup/1 agrees.
    {_, LastKey, LastRef} = lists:last(RItems),
    [[LastRef] = erpc:call(N, actor_receptionist, lookup, [LastKey]) || N <- Nodes],
    PgSize = erpc:call(N1, ?MODULE, pg_join_size, [hd(PItems)]),
    #{rcpt => pcts([L || {L, _} <- RLat]), pg => pcts([L || {L, _} <- PLat]),
      bytes => maps:get(bytes, RCost) / C, pg_bytes => PgSize * NO,
      %% totals over the batches of each kind: gossip bytes, wall time (us),
      %% Node => {BEAM CPU ms, C node CPU ms}
      cost => #{rcpt => RCost, pg => PCost},
      per_node => [{N, median([maps:get(N, M) || {_, M} <- RLat])} || N <- Others]}.

pcts(L) ->
    S = lists:sort(L),
    Len = length(S),
    #{p50 => lists:nth(max(1, ceil(Len * 0.5)), S), p99 => lists:nth(max(1, ceil(Len * 0.99)), S)}.

chunks([], _) -> [];
chunks(L, N) when length(L) =< N -> [L];
chunks(L, N) ->
    {A, B} = lists:split(N, L),
    [A | chunks(B, N)].

%% Gossip sent by Nodes so far (the `gossip' counters of
%% actor_receptionist:status/0): #{sent_bytes, sent} summed over them.
-spec gossip_counters([node()]) -> #{sent_bytes := non_neg_integer(), sent := non_neg_integer()}.
gossip_counters(Nodes) ->
    lists:foldl(fun(N, #{sent_bytes := B, sent := M}) ->
                        case erpc:call(N, actor_receptionist, status, []) of
                            #{gossip := #{sent_bytes := B1, sent := M1}} ->
                                #{sent_bytes => B + B1, sent => M + M1};
                            Other ->
                                fail("no gossip counters in the status of ~p: ~p", [N, Other])
                        end
                end, #{sent_bytes => 0, sent => 0}, Nodes).

%% CPU time so far of each member's BEAM and receptionist C node, read from
%% /proc here (cpu_ms/1): #{Node => {BeamMs, CNodeMs}}. Node must be a
%% member this process started (its OS pids are in the dictionary).
-spec cpu([node()]) -> #{node() => {number(), number()}}.
cpu(Nodes) ->
    Pids = maps:from_list([{N, P} || {{peer, _}, #{node := N} = P} <- get()]),
    maps:from_list([begin
                        #{beam_os_pid := B, cnode_os_pid := C} = maps:get(N, Pids),
                        {N, {cpu_ms(B), cpu_ms(C)}}
                    end || N <- Nodes]).

sample(Nodes) ->
    {gossip_counters(Nodes), cpu(Nodes), erlang:monotonic_time(microsecond)}.

cost({#{sent_bytes := B0}, Cpu0, T0}, {#{sent_bytes := B1}, Cpu1, T1}) ->
    #{bytes => B1 - B0, us => T1 - T0,
      cpu => maps:map(fun(N, {Beam1, C1}) ->
                              {Beam0, C0} = maps:get(N, Cpu0),
                              {Beam1 - Beam0, C1 - C0}
                      end, Cpu1)}.

add_cost(#{bytes := B, us := U, cpu := Cpu}, #{bytes := BA, us := UA, cpu := CpuA}) ->
    #{bytes => B + BA, us => U + UA,
      cpu => maps:fold(fun(N, {Beam, C}, Acc) ->
                               {BeamA, CA} = maps:get(N, Acc, {0, 0}),
                               Acc#{N => {Beam + BeamA, C + CA}}
                       end, CpuA, Cpu)}.

%% Items one at a time on the driver; [{Latency, #{Node => Latency}}].
run_batch(Driver, Kind, Items, NOthers) ->
    MRef = erlang:monitor(process, Driver),
    Driver ! {run, self(), Kind, Items, NOthers},
    receive
        {driver_done, Kind, {ok, Lats}} ->
            erlang:demonitor(MRef, [flush]),
            Lats;
        {driver_done, Kind, {error, Reason}} ->
            fail("~p convergence: ~p", [Kind, Reason]);
        {'DOWN', MRef, process, _, Reason} ->
            fail("the driver on node 1 died: ~p", [Reason])
    after length(Items) * ?SEEN_MS ->
            fail("~p convergence: no answer from the driver on node 1", [Kind])
    end.

%% On node 1.
driver() ->
    receive
        {run, From, Kind, Items, NOthers} ->
            Res = try {ok, [change(Kind, Item, NOthers) || Item <- Items]}
                  catch throw:Reason -> {error, Reason}
                  end,
            From ! {driver_done, Kind, Res},
            driver();
        stop ->
            ok
    end.

change(rcpt, {I, Key, Ref}, NOthers) ->
    T0 = os:system_time(microsecond),
    ok = actor_receptionist:register(Key, Ref),
    seen(rcpt, I, NOthers, T0, #{});
change(pg, {I, Group, Pid}, NOthers) ->
    T0 = os:system_time(microsecond),
    ok = pg:join(?SCOPE, Group, Pid),
    seen(pg, I, NOthers, T0, #{}).

seen(_Kind, _I, 0, T0, Ts) ->
    {lists:max(maps:values(Ts)) - T0, maps:map(fun(_, T) -> T - T0 end, Ts)};
seen(Kind, I, K, T0, Ts) ->
    receive
        {seen, Kind, I, Node, T} -> seen(Kind, I, K - 1, T0, Ts#{Node => T})
    after ?SEEN_MS ->
            throw({change_not_seen, I, {seen_on, maps:keys(Ts)}, {waited_ms, ?SEEN_MS}})
    end.

%% On every other node: one subscriber per key (receptionist) and one
%% pg:monitor/2 watcher per group, each in place when this returns.
subscribe_all(Driver, RItems, PItems) ->
    Self = self(),
    [spawn(?MODULE, rcpt_sub, [Self, Driver, I, Key, Ref]) || {I, Key, Ref} <- RItems],
    [spawn(?MODULE, pg_sub, [Self, Driver, I, Group, Pid]) || {I, Group, Pid} <- PItems],
    ready(length(RItems) + length(PItems)).

ready(0) ->
    ok;
ready(N) ->
    receive
        {ready, _} -> ready(N - 1);
        {not_ready, What} -> {error, What}
    after ?WAIT_MS ->
            {error, {subscribers_not_ready, N, {waited_ms, ?WAIT_MS}}}
    end.

rcpt_sub(Setup, Driver, I, Key, Ref) ->
    ok = actor_receptionist:subscribe(Key, self()),
    receive
        {listing, Key, []} ->
            Setup ! {ready, I},
            rcpt_wait(Driver, I, Key, Ref);
        {listing, Key, Refs} ->
            Setup ! {not_ready, {first_listing_not_empty, Key, Refs}};
        {receptionist_subscribe_rejected, Key, Reason, Limit} ->
            Setup ! {not_ready, {subscribe_rejected, Key, Reason, Limit}}
    end.

rcpt_wait(Driver, I, Key, Ref) ->
    receive
        {listing, Key, Refs} ->
            T = os:system_time(microsecond),
            case lists:member(Ref, Refs) of
                true -> Driver ! {seen, rcpt, I, node(), T}, idle();
                false -> rcpt_wait(Driver, I, Key, Ref)
            end
    end.

pg_sub(Setup, Driver, I, Group, Pid) ->
    {MRef, []} = pg:monitor(?SCOPE, Group),
    Setup ! {ready, I},
    pg_wait(Driver, I, Group, Pid, MRef).

pg_wait(Driver, I, Group, Pid, MRef) ->
    receive
        {MRef, join, Group, Pids} ->
            T = os:system_time(microsecond),
            case lists:member(Pid, Pids) of
                true -> Driver ! {seen, pg, I, node(), T}, idle();
                false -> pg_wait(Driver, I, Group, Pid, MRef)
            end
    end.

%% The message pg's scope sends each other scope for pg:join/3
%% (`broadcast(maps:keys(Remote), {join, self(), Group, PidOrPids})').
pg_join_size({_I, Group, Pid}) ->
    erlang:external_size({join, whereis(?SCOPE), Group, Pid}).

%% ===================================================================
%% Removal (N = 3: node 2 goes)
%% ===================================================================

removal([N1, N2, N3], Cfg) ->
    removal([N1, N3], N2, Cfg).

%% Gone registers rm_keys keys, then halts; watchers on every survivor.
%% Then the pg anchor: a fresh peer joined to the survivors joins as many
%% groups and halts. Cfg: rm_keys, peer_args, `poll_ms' (how often the
%% survivors' watchers poll once the node is gone, default 1), `name'.
-spec removal([node()], node(), map()) -> map().
removal(Survivors, N2, #{rm_keys := K} = Cfg) ->
    Every = maps:get(poll_ms, Cfg, 1),
    %% The receptionist: node 2 registers K keys, then halts.
    %% lookup/1 of 100 keys spread over all (the C node drops key by key).
    Keys = [rm_key(I) || I <- lists:seq(max(1, K div 100), K, max(1, K div 100))],
    Rcpt = removal_run(rcpt, Survivors, N2, K, Keys,
                       fun() -> ok = erpc:call(N2, ?MODULE, register_many, [K, ?RM_PROCS], ?LOAD_MS) end,
                       Every),
    %% pg: a fresh peer joins K groups (1000 processes x K/1000 groups),
    %% then halts. It runs no actor_pool: only pg notices it.
    {_PeerX, X} = start_peer(name(Cfg) ++ "_" ++ os:getpid() ++ "_pgx", Cfg),
    [true = erpc:call(X, net_kernel, connect_node, [N]) || N <- Survivors],
    pg_ready([X | Survivors]),
    Pg = removal_run(pg, Survivors, X, K, [],
                     fun() -> ok = erpc:call(X, ?MODULE, join_many, [K, ?PG_PROCS, ?SCOPE], ?LOAD_MS) end,
                     Every),
    #{rcpt => Rcpt, pg => Pg, nodes => Survivors}.

rm_key(I) ->
    actor_receptionist:service_key(<<"rm-", (integer_to_binary(I))/binary>>).

%% Watchers on the survivors; Load fills; then Gone halts. Per survivor,
%% microseconds from the bench's time just before the halt (loading: from
%% the start of Load).
removal_run(Kind, Survivors, Gone, K, Keys, Load, Every) ->
    Self = self(),
    Watchers = [begin
                    Base = probe(Kind, N),
                    W = erpc:call(N, erlang, spawn,
                                  [?MODULE, watch, [Self, Kind, {Base + K, Base}, Gone, Keys, Every]]),
                    {N, W, erlang:monitor(process, W)}
                end || N <- Survivors],
    TL0 = os:system_time(microsecond),
    Load(),
    Loaded = [{N, watched(W, M, loaded, ?LOAD_MS) - TL0} || {N, W, M} <- Watchers],
    T0 = os:system_time(microsecond),
    erpc:cast(Gone, erlang, halt, []),
    Gones = [{N, watched(W, M, gone, ?WAIT_MS)} || {N, W, M} <- Watchers],
    [erlang:demonitor(M, [flush]) || {_, _, M} <- Watchers],
    #{load => Loaded,
      gone => [{N, maps:map(fun(_, T) -> T - T0 end, Ts)} || {N, {Ts, _}} <- Gones],
      cpu => [{N, Cpu} || {N, {_, Cpu}} <- Gones]}.

watched(W, M, Phase, Timeout) ->
    receive
        {watch, W, Phase, Res} -> Res;
        {watch, W, timeout, What} -> fail("removal: ~p", [What]);
        {'DOWN', M, process, W, Reason} -> fail("removal: the watcher died: ~p", [Reason])
    after Timeout + 5000 ->
            fail("removal: no ~p from the watcher ~p", [Phase, W])
    end.

probe(Kind, Node) ->
    erpc:call(Node, ?MODULE, probe, [Kind]).

probe(rcpt) ->
    case actor_receptionist:stats() of
        #{refs := R} -> R;
        Other -> throw({no_stats, Other})
    end;
probe(pg) ->
    ets:info(?SCOPE, size).

%% On a survivor: wait until the probe reaches Loaded (polled every 5 ms),
%% then until it is back to Base (every Every ms). Beside it, helpers note
%% when `nodedown' arrives and, for the receptionist, when the first and
%% the last of Keys read empty through lookup/1 (the NIF's snapshot read,
%% no message) and when the C node's own `refs' is back to Base (both
%% polled every Every ms): the probe itself (stats/0) queues behind the
%% receptionist server's work.
-spec watch(pid(), rcpt | pg, {non_neg_integer(), non_neg_integer()}, node(), [term()],
            pos_integer()) -> term().
watch(Parent, Kind, {Loaded, Base}, Gone, Keys, Every) ->
    Self = self(),
    _ = spawn_link(fun() ->
                           true = erlang:monitor_node(Gone, true),
                           receive {nodedown, Gone} -> Self ! {at, down, os:system_time(microsecond)} end
                   end),
    case poll(fun() -> probe(Kind) end, fun(V) -> V >= Loaded end, 5, ?LOAD_MS) of
        {ok, TL} ->
            [case [K || K <- Keys, actor_receptionist:lookup(K) =:= []] of
                 [] -> ok;
                 Missing -> exit({not_in_lookup_when_loaded, Missing})
             end || Keys =/= []],
            _ = [spawn_link(fun() ->
                                    Left = fun() -> length([K || K <- Keys, actor_receptionist:lookup(K) =/= []]) end,
                                    NK = length(Keys),
                                    {ok, T1} = poll(Left, fun(L) -> L < NK end, Every, ?WAIT_MS),
                                    {ok, T2} = poll(Left, fun(L) -> L =:= 0 end, Every, ?WAIT_MS),
                                    Self ! {at, lookup_first, T1},
                                    Self ! {at, lookup, T2}
                            end) || Keys =/= []],
            _ = [spawn_link(fun() ->
                                    {ok, T} = poll(fun cnode_refs/0, fun(V) -> V =< Base end, Every,
                                                   ?WAIT_MS),
                                    Self ! {at, cnode, T}
                            end) || Kind =:= rcpt],
            #{os_pid := COsPid} = actor_cnode:info(actor_receptionist_owner),
            OsPids = [list_to_integer(os:getpid()), COsPid],
            Cpu0 = [cpu_ms(P) || P <- OsPids],
            Parent ! {watch, self(), loaded, TL},
            case poll(fun() -> probe(Kind) end, fun(V) -> V =< Base end, Every, ?WAIT_MS) of
                {ok, TG} ->
                    [BeamCpu, CCpu] = [cpu_ms(P) - C0 || {P, C0} <- lists:zip(OsPids, Cpu0)],
                    Ats = [receive {at, What, T} -> {What, T}
                           after ?WAIT_MS -> exit({no, What, node(), Gone})
                           end || What <- [down] ++ [lookup_first || Keys =/= []] ++ [lookup || Keys =/= []]
                                     ++ [cnode || Kind =:= rcpt]],
                    Parent ! {watch, self(), gone, {maps:from_list([{gone, TG} | Ats]),
                                                    #{beam_cpu => BeamCpu, cnode_cpu => CCpu}}};
                {timeout, V} ->
                    Parent ! {watch, self(), timeout, {Kind, not_back_to, Base, node(), V}}
            end;
        {timeout, V} ->
            Parent ! {watch, self(), timeout, {Kind, not_loaded, Loaded, node(), V}}
    end.

%% The C node's own count, asked directly (stats/0 asks through the
%% receptionist server, behind whatever it has queued).
cnode_refs() ->
    Node = actor_receptionist:receptionist_node(),
    #{refs := R} = gen_server:call({actor_receptionist, Node}, stats, ?WAIT_MS),
    R.

%% CPU time (all threads) of an OS process so far, ms: the run time of its
%% threads in /proc/PID/task/TID/schedstat (ns) when the kernel keeps it,
%% else user + system time from /proc/PID/stat, whose 10 ms ticks are too
%% coarse for a fraction of a millisecond per change. schedstat forgets
%% threads that exited; the BEAM's and the C node's live as long as they do.
-spec cpu_ms(non_neg_integer()) -> number().
cpu_ms(OsPid) ->
    Dir = "/proc/" ++ integer_to_list(OsPid) ++ "/task",
    Tids = case file:list_dir(Dir) of
               {ok, Ts} -> Ts;
               {error, _} -> []
           end,
    %% A thread that exits between the listing and the read is skipped.
    case [binary_to_integer(hd(binary:split(B, <<" ">>)))
          || T <- Tids, {ok, B} <- [file:read_file(filename:join([Dir, T, "schedstat"]))]] of
        [] -> stat_cpu_ms(OsPid);
        Ns -> lists:sum(Ns) / 1.0e6
    end.

stat_cpu_ms(OsPid) ->
    {ok, Stat} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/stat"),
    %% The fields after the command name (which may hold spaces).
    [_, After] = string:split(Stat, ")", trailing),
    Fields = string:lexemes(binary_to_list(After), " "),
    Ticks = list_to_integer(lists:nth(12, Fields)) + list_to_integer(lists:nth(13, Fields)),
    Ticks * 10.

%% Probe every Every ms until Done, for at most Ms; {ok,
%% os:system_time(microsecond) just after the probe that was done} or
%% {timeout, LastValue}.
poll(Probe, Done, Every, Ms) ->
    Stamped = fun() -> V = Probe(), {V, os:system_time(microsecond)} end,
    case ap_support:poll(Stamped, fun({V, _T}) -> Done(V) end, Ms, Every) of
        {ok, {_V, T}} -> {ok, T};
        {timeout, {V, _T}} -> {timeout, V}
    end.

%% On node 2: K keys, one ref each, refs spread over P idle processes.
register_many(K, P) ->
    Refs = list_to_tuple(spawn_idle(P)),
    [ok = actor_receptionist:register(rm_key(I), element(1 + I rem P, Refs))
     || I <- lists:seq(1, K)],
    ok.

%% On the pg peer: K groups, each joined by one of P processes (pg:leave/3
%% and the scope's bookkeeping walk a process's groups: keep them few).
join_many(K, P, Scope) ->
    Pids = list_to_tuple(spawn_idle(P)),
    [ok = pg:join(Scope, {rm, I}, element(1 + I rem P, Pids)) || I <- lists:seq(1, K)],
    ok.

%% ===================================================================
%% Report
%% ===================================================================

conv_rows(N, #{rcpt := R, pg := P, bytes := B, pg_bytes := PB}) ->
    Tag = "N=" ++ integer_to_list(N) ++ " ",
    [{Tag ++ "convergence p50 (us)", maps:get(p50, R),
      [{"pg join -> monitor notice p50", maps:get(p50, P)}],
      {le, maps:get(p50, P), 2.0, "<= 2x pg"}},
     {Tag ++ "convergence p99 (us)", maps:get(p99, R),
      [{"pg join -> monitor notice p99", maps:get(p99, P)}],
      {lt_abs, 50000, "< 50 ms"}},
     {Tag ++ "gossip bytes per change", B,
      [{"pg {join,..} message x " ++ integer_to_list(N - 1), PB}], none}].

removal_rows(#{rcpt := R, pg := P, nodes := [N1, N3]}, #{rm_keys := K}) ->
    Gone = fun(Run, N, What) ->
                   case maps:get(What, proplists:get_value(N, maps:get(gone, Run)), undefined) of
                       undefined -> undefined;
                       Us -> Us / 1000
                   end
           end,
    Load = fun(Run, N) -> proplists:get_value(N, maps:get(load, Run)) / 1000 end,
    Cpu = fun(Run, N, What) -> maps:get(What, proplists:get_value(N, maps:get(cpu, Run))) end,
    KT = integer_to_list(K div 1000) ++ "K",
    lists:append(
      [[{"N=3 removal of " ++ KT ++ " regs, " ++ Name ++ " (ms)", Gone(R, N, gone),
         [{"pg, " ++ KT ++ " groups gone on " ++ Name, Gone(P, N, gone)}],
         {lt_abs, 200, "< 200 ms"}},
        {"  halt -> nodedown (ms)", Gone(R, N, down), [{"pg run: halt -> nodedown", Gone(P, N, down)}], none},
        {"  halt -> first of 100 keys [] (ms)", Gone(R, N, lookup_first), [], none},
        {"  halt -> all 100 keys [] (ms)", Gone(R, N, lookup), [], none},
        {"  halt -> C node's own refs back (ms)", Gone(R, N, cnode), [], none},
        {"  C node CPU meanwhile (ms)", Cpu(R, N, cnode_cpu), [], none},
        {"  BEAM CPU meanwhile (ms)", Cpu(R, N, beam_cpu),
         [{"pg run: BEAM CPU meanwhile", Cpu(P, N, beam_cpu)}], none}]
       || {N, Name} <- [{N1, "node 1"}, {N3, "node 3"}]]) ++
    [{KT ++ " regs of node 2 reach " ++ Name ++ " (ms)", Load(R, N),
      [{KT ++ " pg joins reach " ++ Name, Load(P, N)}], none}
     || {N, Name} <- [{N1, "node 1"}, {N3, "node 3"}]].

%% Rows: {Label, Value, [{AnchorLabel, AnchorValue}], Target}.

%% ===================================================================
%% Helpers
%% ===================================================================

spawn_idle(N) ->
    [spawn(?MODULE, idle, []) || _ <- lists:seq(1, N)].

idle() ->
    receive stop -> ok end.
