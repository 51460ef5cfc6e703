%% @doc Metrics in the Prometheus text format (version 0.0.4).
%%
%% {@link render/0} returns what the pools, the batchers, the receptionist
%% and the C nodes of this BEAM do, as iodata, for any HTTP endpoint you
%% already run:
%% ```
%% Body = actor_pool_metrics:render(),
%% Headers = [{"content-type", actor_pool_metrics:content_type()}]
%% '''
%% With the application setting `metrics_port' (an integer; off by default)
%% the application also serves `GET /metrics' itself (a small gen_tcp
%% server with fixed limits: actor_pool_metrics_http), bound to `metrics_ip'
%% (default `{127,0,0,1}': the numbers are not for the world unless you say
%% so). Every metric and its labels, and the endpoint's limits, are listed
%% in docs/operations.md ("Metrics").
%%
%% Each scrape reads the same sources as `actor_pool:stats/1',
%% `actor_receptionist:stats/0' and `actor_cnode:info/1' (one call per
%% pool and C node, bounded by a short timeout each); a source that does not
%% answer leaves its samples out of that scrape rather than failing it.
-module(actor_pool_metrics).

-include("actor_pool_int.hrl").

-export([render/0]).
-export([content_type/0]).
-export([start_link/0]).
-export([port/0]).

-define(CALL_TIMEOUT, 2000).

-type family() :: {Name :: string(), counter | gauge, Help :: string(),
                   [{[{string(), term()}], number()}]}
                | {Name :: string(), histogram, Help :: string(),
                   [{[{string(), term()}], actor_pool_latency:histogram()}]}.

%% ===================================================================
%% API
%% ===================================================================

%% @doc The metrics, in the Prometheus text format 0.0.4.
-spec render() -> iodata().
render() ->
    [family(F) || {_, _, _, [_ | _]} = F <- families()].

%% @doc The content type to serve {@link render/0} under.
-spec content_type() -> string().
content_type() ->
    "text/plain; version=0.0.4; charset=utf-8".

%% @doc Starts the HTTP endpoint on `metrics_port' and `metrics_ip'
%% (application env); `ignore' when `metrics_port' is not set. Called by
%% the application's supervisor.
-spec start_link() -> {ok, pid()} | ignore | {error, term()}.
start_link() ->
    case application:get_env(actor_pool, metrics_port, undefined) of
        Port when is_integer(Port), Port >= 0, Port =< 65535 ->
            Ip = application:get_env(actor_pool, metrics_ip, {127, 0, 0, 1}),
            case inet:parse_address(ip_string(Ip)) of
                {ok, Addr} -> actor_pool_metrics_http:start_link(Addr, Port);
                {error, _} -> {error, {badarg, {metrics_ip, Ip}}}
            end;
        undefined ->
            ignore;
        Other ->
            {error, {badarg, {metrics_port, Other}}}
    end.

%% @doc The port the endpoint listens on (the one the OS chose, when
%% `metrics_port' is 0).
-spec port() -> {ok, inet:port_number()} | {error, not_started}.
port() ->
    actor_pool_metrics_http:port().

ip_string(Ip) when is_tuple(Ip) -> inet:ntoa(Ip);
ip_string(Ip) when is_list(Ip) -> Ip;
ip_string(Ip) when is_binary(Ip) -> binary_to_list(Ip);
ip_string(_) -> "".

%% ===================================================================
%% The families
%% ===================================================================

-spec families() -> [family()].
families() ->
    Local = actor_pool:pool_node(),
    %% undefined (not []) when the pool node does not answer: the ask
    %% histograms of its pools are kept then.
    LocalPools = case Local of
                     undefined -> undefined;
                     _ -> pools_of(Local)
                 end,
    Listed = case LocalPools of
                 L when is_list(L) -> L;
                 undefined -> []
             end,
    pool_families(pool_stats(Listed)) ++ ask_families(Local, LocalPools) ++ key_families()
        ++ batcher_families() ++ receptionist_families() ++ cnode_families().

%% [{PoolName, PoolNode, Stats}] of every pool this node lists.
pool_stats(Listed) ->
    [{Name, node(Pid), S} || {Name, Pid} <- Listed,
                             S <- [safe(fun() -> actor_pool:stats(Pid) end)],
                             is_map(S)].

pool_families(Pools) ->
    L = fun(Name, Node) -> [{"pool", Name}, {"node", Node}] end,
    C = fun(Key) -> [{L(N, Nd), maps:get(Key, S, 0)} || {N, Nd, S} <- Pools] end,
    [{"actor_pool_processed_total", counter,
      "Messages the pool's workers handled (refusals included, crashes not).",
      C(processed)},
     {"actor_pool_errors_total", counter,
      "Messages the pool's handler refused ({error, Reason} answers).", C(errors)},
     {"actor_pool_crashes_total", counter,
      "Workers lost, by cause: signal, exit, timeout (handler_timeout_ms), handler "
      "(the handler reported a crash).",
      [{L(N, Nd) ++ [{"cause", Cause}], V}
       || {N, Nd, S} <- Pools,
          {Cause, V} <- lists:sort(maps:to_list(maps:get(crash_causes, S, #{})))]},
     {"actor_pool_restarts_total", counter, "Workers replaced after a crash.", C(restarts)},
     {"actor_pool_overloaded_total", counter,
      "Asks answered {error, overloaded}: every mailbox was full.", C(overloaded)},
     {"actor_pool_dropped_tells_total", counter,
      "Tells dropped, by reason: mailbox_full (every mailbox of the pool was full), no_pool "
      "(no pool of that name, pid or service key: counted by the pool node, or by this node), "
      "oversized (too large for a frame of the pool node), ring_full (a same-host ring stayed "
      "full for a second).",
      [{L(N, Nd) ++ [{"reason", "mailbox_full"}], maps:get(dropped_tells, S, 0)}
       || {N, Nd, S} <- Pools] ++ node_drops()},
     {"actor_pool_bad_replies_total", counter,
      "Asks answered {error, bad_reply}: the handler's reply was one the caller's node would "
      "refuse, or carried an atom past max_reply_atoms.", C(bad_replies)},
     {"actor_pool_ran_on_loop_total", counter,
      "Messages a sleeping worker's state handled on the pool node's event loop "
      "(short messages of the built-in handlers: no wake-up).", C(ran_on_loop)},
     {"actor_pool_messages_total", counter,
      "Messages the pool received, by transport: ring (same-host shared memory) or "
      "dist (distribution).",
      [{L(N, Nd) ++ [{"transport", T}], V}
       || {N, Nd, S} <- Pools, {T, V} <- lists:sort(maps:to_list(maps:get(by_path, S, #{})))]},
     {"actor_pool_workers", gauge, "Workers the pool was started with.", C(size)},
     {"actor_pool_worker_mailbox_depth", gauge, "Messages waiting in a worker's mailbox.",
      [{L(N, Nd) ++ [{"worker", maps:get(id, W)}], maps:get(mailbox, W, 0)}
       || {N, Nd, S} <- Pools, W <- maps:get(workers, S, [])]},
     {"actor_pool_worker_processed_total", counter, "Messages a worker handled.",
      [{L(N, Nd) ++ [{"worker", maps:get(id, W)}], maps:get(processed, W, 0)}
       || {N, Nd, S} <- Pools, W <- maps:get(workers, S, [])]},
     {"actor_pool_stalls_total", counter,
      "Workers found busy on one message past stall_ms (their queue moved to the others).",
      C(stalls)},
     {"actor_pool_worker_up", gauge,
      "1 when the worker is running, 0 when it is stalled, hung or waiting to be replaced.",
      [{L(N, Nd) ++ [{"worker", maps:get(id, W)}],
        case maps:get(state, W, running) of running -> 1; _ -> 0 end}
       || {N, Nd, S} <- Pools, W <- maps:get(workers, S, [])]},
     {"actor_pool_handler_duration_seconds", histogram,
      "Time the pool's handler took per ask (tells are not timed), measured on the pool "
      "node around each call (in a worker process, by that process).",
      [{L(N, Nd), H} || {N, Nd, S} <- Pools, H <- [histogram(maps:get(handler_time, S, none))],
                        H =/= none]}].

%% Drops counted by no pool: this node's (oversized, ring_full, no_pool:
%% a service key with no pool, a name and no pool node), and its pool
%% node's tells to a name or pid it does not know.
node_drops() ->
    Here = [{"node", node()}],
    #{tells := Oversized} = actor_pool:oversized(),
    RingFull = case safe(fun() -> actor_pool_dp:counters() end) of
                   #{tell_dropped := RF} -> RF;
                   _ -> 0
               end,
    PoolNode = case actor_pool:pool_node() of
                   undefined ->
                       [];
                   Node ->
                       Stats = fun() -> actor_pool_transport:node_stats(Node, ?CALL_TIMEOUT) end,
                       case safe(Stats) of
                           #{no_pool_tells := V} when is_integer(V), V >= 0 ->
                               [{[{"node", Node}, {"reason", "no_pool"}], V}];
                           _ ->
                               []
                       end
               end,
    [{Here ++ [{"reason", "no_pool"}], actor_pool:no_pool_tells()},
     {Here ++ [{"reason", "oversized"}], Oversized},
     {Here ++ [{"reason", "ring_full"}], RingFull}] ++ PoolNode.

%% A pool node's handler_time, checked (a pool node of another version may
%% send none, or another shape): none, or what family/1 renders.
histogram(#{bounds_ns := Bounds, counts := Counts, sum_ns := Sum})
  when is_list(Bounds), is_list(Counts), is_integer(Sum), Sum >= 0,
       length(Counts) =:= length(Bounds) + 1 ->
    Ok = lists:all(fun(B) -> is_integer(B) andalso B > 0 end, Bounds)
        andalso lists:sort(Bounds) =:= Bounds andalso lists:usort(Bounds) =:= Bounds
        andalso lists:all(fun(C) -> is_integer(C) andalso C >= 0 end, Counts),
    case Ok of
        true -> {Bounds, Counts, Sum};
        false -> none
    end;
histogram(_) ->
    none.

%% The ask round trips this node measured (actor_pool_latency), per pool.
%% The pools of each pool node they went to are listed (this node's own
%% are at hand), so that those gone are left out and forgotten; a pool
%% node that does not answer keeps its pools.
ask_families(Local, LocalPools) ->
    Hists = actor_pool_latency:histograms(),
    Nodes = lists:usort([Nd || {_, Nd, _} <- Hists]),
    Alive = maps:from_list(
              [{Nd, A} || Nd <- Nodes,
                          A <- [case Nd =:= Local of
                                    true -> LocalPools;
                                    false -> pools_of(Nd)
                                end],
                          is_list(A)]),
    _ = [actor_pool_latency:forget(Nd, A) || {Nd, A} <- maps:to_list(Alive)],
    [{"actor_pool_ask_duration_seconds", histogram,
      "Round trip of asks from this node to the pool (actor_pool:ask/2,3), whatever the "
      "answer: from the send to the answer's arrival (by ring: from the record's submit to the "
      "answer's hand-over, timed by the data-plane NIF).",
      [{[{"pool", N}, {"node", Nd}], H}
       || {N, Nd, H} <- Hists,
          case Alive of
              #{Nd := A} -> lists:keymember(N, 1, A);
              #{} -> true
          end]}].

%% Calls by service key from this node, per pool reached by key
%% (actor_pool_route; actor_pool:key_stats/1 shows the same).
key_families() ->
    Pools = safe(fun() -> actor_pool_route:pools() end),
    Rows = case Pools of
               L when is_list(L) -> L;
               _ -> []
           end,
    Ls = fun({service_key, Id}, Name, Node) -> [{"key", Id}, {"pool", Name}, {"node", Node}] end,
    C = fun(K) -> [{Ls(Key, N, Nd), maps:get(K, S)} || {Key, N, Nd, S} <- Rows] end,
    [{"actor_pool_key_asks_in_flight", gauge,
      "Asks by service key this node sent to the pool and has no answer to yet.", C(in_flight)},
     {"actor_pool_key_asks_total", counter, "Asks by service key this node sent to the pool.",
      C(asks)},
     {"actor_pool_key_tells_total", counter, "Tells by service key this node sent to the pool.",
      C(tells)},
     {"actor_pool_key_timeouts_total", counter,
      "Asks by service key to the pool that got no answer within their timeout.", C(timeouts)},
     {"actor_pool_key_set_asides_total", counter,
      "Times this node set the pool aside (an ask by key to it timed out, or its connection "
      "was lost): no call by key goes to it until one probe ask is answered.", C(set_asides)},
     {"actor_pool_key_set_aside", gauge, "1 while this node keeps the pool set aside.",
      [{Ls(Key, N, Nd), case maps:get(set_aside, S) of true -> 1; false -> 0 end}
       || {Key, N, Nd, S} <- Rows]},
     {"actor_pool_key_spills_total", counter,
      "Asks by service key the pool answered overloaded (not run) that went on to another pool "
      "under the key (with idempotent, also those it failed with nodedown, noproc or stopped).",
      C(spills)}].

%% The pools of a pool node, `[{Name, Pid}]', or undefined when it does
%% not answer.
pools_of(Node) ->
    case safe(fun() -> actor_pool_transport:call(Node, {?MANAGER, Node}, which_pools,
                                                 ?CALL_TIMEOUT) end) of
        L when is_list(L) -> L;
        _ -> undefined
    end.

batcher_families() ->
    Groups = try actor_pool_batch_sup:batchers() catch _:_ -> [] end,
    [{"actor_pool_batcher_queued", gauge,
      "Items handed to a batcher and not yet sent to its pool node.",
      [{[{"node", Node}, {"batcher", I}], Q}
       || {Node, _} <- Groups, {I, Q} <- numbered(actor_pool_batcher:queued(Node))]}].

numbered(L) -> lists:zip(lists:seq(1, length(L)), L).

receptionist_families() ->
    Stats = safe(fun() -> actor_receptionist:stats() end),
    Status = safe(fun() -> actor_receptionist:status() end),
    case {Stats, Status} of
        {#{status := up} = S, #{} = St} ->
            Local = maps:get(local_registrations, S, 0),
            [{"actor_receptionist_keys", gauge, "Service keys with registrations or subscribers.",
              [{[], maps:get(keys, S, 0)}]},
             {"actor_receptionist_refs", gauge,
              "Registrations held, by origin: local (this node's) or members (learnt from "
              "the other members).",
              [{[{"origin", "local"}], Local},
               {[{"origin", "members"}], max(0, maps:get(refs, S, 0) - Local)}]},
             {"actor_receptionist_subscribers", gauge, "Live subscriptions.",
              [{[], maps:get(subscriptions, S, 0)}]},
             {"actor_receptionist_members", gauge, "Other receptionists this one replicates with.",
              [{[], length(maps:get(members, St, []))}]},
             {"actor_receptionist_view_complete", gauge,
              "1 when this receptionist holds the registrations of every member it knows.",
              [{[], case maps:get(complete, St, false) of true -> 1; _ -> 0 end}]},
             {"actor_receptionist_origin_drops_total", counter,
              "Other members' registrations dropped as a whole (the member left).",
              [{[], maps:get(origin_drops, S, 0)}]}]
                ++ gossip_families(maps:get(gossip, St, #{}));
        _ ->
            []
    end.

gossip_families(G) ->
    [{"actor_receptionist_gossip_messages_total", counter,
      "Gossip messages (deltas, digests, states) this receptionist sent or received.",
      [{[{"direction", D}], V} || {D, K} <- [{"sent", sent}, {"received", received}],
                                  V <- [maps:get(K, G, undefined)], is_integer(V)]},
     {"actor_receptionist_gossip_bytes_total", counter,
      "Bytes (external term size) of the gossip messages sent or received.",
      [{[{"direction", D}], V} || {D, K} <- [{"sent", sent_bytes}, {"received", received_bytes}],
                                  V <- [maps:get(K, G, undefined)], is_integer(V)]},
     {"actor_receptionist_full_syncs_total", counter,
      "Whole states taken in: a member's (a gap in its deltas, a new incarnation) or an "
      "origin's through a relay.",
      [{[], V} || V <- [maps:get(full_syncs, G, undefined)], is_integer(V)]},
     {"actor_receptionist_member_drops_total", counter,
      "Members that left (nodedown, or their receptionist stopped).",
      [{[], V} || V <- [maps:get(member_drops, G, undefined)], is_integer(V)]},
     {"actor_receptionist_gossip_rejected_total", counter,
      "Gossip messages dropped unread: not on the channel of the receptionist they claim to "
      "come from (made up, of a channel closed since, or of an older version).",
      [{[], V} || V <- [maps:get(rejected, G, undefined)], is_integer(V)]}].

%% [{Role, Pid}] of the C-node owners of this BEAM.
cnodes() ->
    Named = [{Role, P} || {Role, Name} <- [{"pool", actor_pool_node_owner},
                                           {"receptionist", actor_receptionist_owner}],
                          P <- [whereis(Name)], is_pid(P)],
    Other = [{"other", P} || {_, P, worker, _} <- safe_children(actor_cnode_sup), is_pid(P)],
    Named ++ Other.

cnode_families() ->
    Infos = [{Role, I} || {Role, P} <- cnodes(),
                          I <- [safe(fun() -> actor_cnode:info(P) end)], is_map(I)],
    L = fun(Role, I) -> [{"cnode", maps:get(node, I, "")}, {"role", Role}] end,
    Os = [{Role, I, OsPid} || {Role, I} <- Infos,
                              OsPid <- [maps:get(os_pid, I, undefined)], is_integer(OsPid)],
    [{"actor_pool_cnode_up", gauge,
      "1 when the C node is up, 0 while it is starting or restarting; io is its I/O "
      "backend.",
      [{L(R, I) ++ [{"io", maps:get(io, I, unknown)}],
        case maps:get(status, I, down) of up -> 1; _ -> 0 end} || {R, I} <- Infos]},
     {"actor_pool_cnode_restarts_total", counter, "Times the C node was restarted.",
      [{L(R, I), maps:get(restarts, I, 0)} || {R, I} <- Infos]},
     {"actor_pool_cnode_resident_memory_bytes", gauge, "The C node's resident memory.",
      [{L(R, I), V} || {R, I, OsPid} <- Os, V <- [rss_bytes(OsPid)], is_integer(V)]},
     {"actor_pool_cnode_uptime_seconds", gauge, "Seconds since the C node's OS process started.",
      [{L(R, I), V} || {R, I, OsPid} <- Os, V <- [uptime_s(OsPid)], is_number(V)]}].

%% ===================================================================
%% /proc
%% ===================================================================

rss_bytes(OsPid) ->
    case file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/status") of
        {ok, B} ->
            case re:run(B, "VmRSS:\\s+(\\d+) kB", [{capture, all_but_first, list}]) of
                {match, [Kb]} -> list_to_integer(Kb) * 1024;
                nomatch -> undefined
            end;
        {error, _} ->
            undefined
    end.

%% Field 22 of /proc/PID/stat (start time, clock ticks after boot) against
%% /proc/uptime. The comm field may hold spaces: split after its ')'.
uptime_s(OsPid) ->
    try
        {ok, Stat} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/stat"),
        {ok, Up} = file:read_file("/proc/uptime"),
        [_, After] = string:split(Stat, ")", trailing),
        Start = list_to_integer(binary_to_list(lists:nth(20, string:lexemes(After, " ")))),
        [UpS | _] = string:lexemes(Up, " "),
        Hz = clock_ticks(),
        %% Ticks are 1/Hz s: two decimals say all there is.
        max(0.0, round((binary_to_float(UpS) - Start / Hz) * 100) / 100)
    catch
        _:_ -> undefined
    end.

%% USER_HZ: 100 on every Linux port that matters; getconf says for sure.
clock_ticks() ->
    case persistent_term:get({?MODULE, clk_tck}, undefined) of
        undefined ->
            Hz = case string:to_integer(os:cmd("getconf CLK_TCK")) of
                     {N, _} when is_integer(N), N > 0 -> N;
                     _ -> 100
                 end,
            persistent_term:put({?MODULE, clk_tck}, Hz),
            Hz;
        Hz ->
            Hz
    end.

%% ===================================================================
%% The text format
%% ===================================================================

family({Name, histogram, Help, Samples}) ->
    ["# HELP ", Name, $\s, escape_help(Help), $\n,
     "# TYPE ", Name, " histogram\n",
     [histogram_lines(Name, Ls, H) || {Ls, H} <- Samples]];
family({Name, Type, Help, Samples}) ->
    ["# HELP ", Name, $\s, escape_help(Help), $\n,
     "# TYPE ", Name, $\s, atom_to_list(Type), $\n,
     [[Name, labels(Ls), $\s, value(V), $\n] || {Ls, V} <- Samples]].

%% Cumulative buckets (le in seconds, then +Inf), the sum in seconds, and
%% the count: the +Inf bucket, so the two always agree.
histogram_lines(Name, Ls, {Bounds, Counts, SumNs}) ->
    {Cum, _} = lists:mapfoldl(fun(C, Acc) -> {Acc + C, Acc + C} end, 0, Counts),
    Les = [le(B) || B <- Bounds] ++ ["+Inf"],
    [[[Name, "_bucket", labels(Ls ++ [{"le", Le}]), $\s, value(C), $\n]
      || {Le, C} <- lists:zip(Les, Cum)],
     Name, "_sum", labels(Ls), $\s, value(SumNs / 1.0e9), $\n,
     Name, "_count", labels(Ls), $\s, value(lists:last(Cum)), $\n].

%% A bound in ns as seconds, exactly: 2500 -> "0.0000025", 10^9 -> "1".
le(Ns) ->
    S = integer_to_list(Ns div 1000000000),
    case Ns rem 1000000000 of
        0 -> S;
        F -> S ++ "." ++ string:trim(lists:flatten(io_lib:format("~9..0B", [F])), trailing, "0")
    end.

labels([]) -> [];
labels(Ls) ->
    [${, lists:join($,, [[K, "=\"", label_value(V), $"] || {K, V} <- Ls]), $}].

%% UTF-8, with the format's escapes.
label_value(V) ->
    unicode:characters_to_binary(escape_label(to_chars(V))).

value(V) when is_integer(V) -> integer_to_list(V);
value(V) when is_float(V) -> float_to_list(V, [short]).

to_chars(V) when is_atom(V) -> atom_to_list(V);
to_chars(V) when is_integer(V) -> integer_to_list(V);
to_chars(V) when is_binary(V); is_list(V) ->
    case unicode:characters_to_list(V) of
        L when is_list(L) -> L;
        _ -> lists:flatten(io_lib:format("~0p", [V]))
    end;
to_chars(V) -> lists:flatten(io_lib:format("~0tp", [V])).

%% The format's escapes: in HELP \\ and \n; in label values also \".
escape_help(S) -> lists:flatmap(fun($\\) -> "\\\\"; ($\n) -> "\\n"; (C) -> [C] end, S).
escape_label(S) ->
    lists:flatmap(fun($\\) -> "\\\\"; ($\n) -> "\\n"; ($") -> "\\\""; (C) -> [C] end, S).

safe(F) ->
    try F() catch _:_ -> undefined end.

safe_children(Sup) ->
    try supervisor:which_children(Sup) catch _:_ -> [] end.
