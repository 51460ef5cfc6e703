%% The soak (`make soak', soak/run): three BEAM peers running the
%% application (each with its pool and receptionist C nodes) and one
%% standalone pool node, under a steady mix of tells, asks (by ring and by
%% distribution, by pool and by service key), registrations,
%% deregistrations and subscriptions, while a chaos process, driven by a
%% printed seed, kills C nodes and peers, sends oversized and malformed
%% input, holds idle and slow clients and cuts a link between network
%% namespaces.
%%
%% This node (hidden, no application) drives: it starts the peers, keeps
%% the ledger of what the load was acknowledged or sent, and checks. The
%% run is cut into epochs; at the end of each the load pauses (each worker
%% finishes its operation: an ask that never returns shows as a worker
%% that never pauses) and the tells each tell pool processed are compared
%% with the tells sent to it, on every pool node that no fault touched in
%% that epoch; so are the asks answered in it (none with another
%% message's payload, none raising, none later than its timeout and a
%% margin). At the end: registrations converge to the ledger, every
%% subscriber's last listing agrees, memory did not grow, and nothing (OS
%% process, /dev/shm segment, epmd name) is left. It prints a table and
%% halts with 1 on any failure.
%%
%% SOAK_INJECT makes the first peer (the witness) misbehave in one way,
%% so that a run shows the rule that must catch it failing: `wrong_reply'
%% (its soak_ask_dist pool runs c_src/test/plugin_misecho.c, which answers
%% every 50th ask of a worker with the message before it), `raise' (its
%% worker's every 100th ask carries a closure: actor_pool:ask raises
%% badarg), `late' (that pool's every 50th ask of a worker is answered
%% after 3.5 s, and the worker asks it with a timeout long enough to get
%% it), `reset' (its soak_tell pool is stopped and started again in each
%% epoch after the first, with no fault recorded).
%%
%% Over 700 lines on purpose: the load, the chaos and the checks share one
%% ledger and one epoch clock, and a reader follows one run top to bottom.
-module(ap_soak).

-export([main/1]).
%% Run on the peers.
-export([peer_setup/1, worker/4, settled_memory/2, leaker/0]).

-define(KEYS, [<<"soak.k1">>, <<"soak.k2">>, <<"soak.k3">>, <<"soak.k4">>]).
-define(ASK_KEY, <<"soak.ask">>).
-define(ASK_TIMEOUT, 2000).
%% An ask must end within its timeout plus this.
-define(ASK_MARGIN, 1000).
%% A pool's uptime grows with the driver's clock: less by this much than
%% the time from one stats call's end to a later one's start, it was
%% started again.
-define(UPTIME_SLACK_MS, 2000).
-define(REG_TIMEOUT, 5000).
-define(PACE_MS, 4).
-define(MAX_FRAME, 1048576).
-define(CONVERGE_MS, 20000).
-define(WAIT_MS, 20000).
-define(GROWTH, 0.10).
%% At each epoch end, memory is sampled this many times, this far apart
%% (after the first), and the least value is kept (see sample_memory/1).
-define(MEM_SAMPLES, 5).
-define(MEM_GAP_MS, 500).
-define(SHM_MB, 16).
-define(WITNESS, 1).
%% Faults, with their weights.
-define(FAULTS, [{kill_pool_cnode, 3}, {kill_rcpt_cnode, 3}, {kill_peer, 2},
                 {kill_standalone, 2}, {oversized, 4}, {malformed, 3}, {idle_clients, 2},
                 {slow_clients, 2}, {netns_cut, 1}]).

%% ===================================================================
%% Entry point
%% ===================================================================

-spec main([string()]) -> no_return().
main(Args) ->
    {Secs, Seed} = case Args of
                       [S] -> {list_to_integer(S), fresh_seed()};
                       [S, ""] -> {list_to_integer(S), fresh_seed()};
                       [S, Sd] -> {list_to_integer(S), list_to_integer(Sd)}
                   end,
    io:format("soak: ~b s, seed ~b (SOAK_SEED=~b to repeat)~n", [Secs, Seed, Seed]),
    case inject() of
        none -> ok;
        How -> io:format("soak: SOAK_INJECT=~s: the witness misbehaves; this run must fail~n", [How])
    end,
    rand:seed(exsss, Seed),
    Code = try run(Secs, Seed)
           catch C:R:St ->
                   io:format("soak: driver crashed: ~p:~p~n~p~n", [C, R, St]),
                   %% Whatever it started goes: the peers' C nodes exit
                   %% when their BEAM does.
                   [kill(P) || {{os_pid, P}, _} <- get()],
                   [file:del_dir_r(D) || {{dir, D}, _} <- get()],
                   2
           end,
    erlang:halt(Code).

fresh_seed() ->
    erlang:system_time(microsecond) rem 1000000007.

run(Secs, Seed) ->
    Prefix = "soak" ++ os:getpid(),
    Dir = ap_test_util:temp_dir(Prefix),
    put({dir, Dir}, true),
    Cookie = filename:join(Dir, "cookie"),
    ok = file:write_file(Cookie, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(Cookie, 8#600),
    Ledger = spawn_link(fun() -> ledger(#{}) end),
    register(ap_soak_ledger, Ledger),
    S0 = #{prefix => Prefix, dir => Dir, cookie => Cookie, seed => Seed, ledger => Ledger,
           peers => #{}, incarnation => 0, pids => [], faults => #{}, failures => [],
           netns => netns_check()},
    S1 = lists:foldl(fun(I, Acc) -> start_peer(I, Acc) end, S0, [1, 2, 3]),
    S2 = start_standalone(S1),
    mesh(S2),
    %% Epochs of at most 30 s: memory is sampled at the end of each.
    EpochS = max(5, min(30, Secs div 6)),
    Epochs = max(1, Secs div EpochS),
    T1 = case Secs >= 240 of true -> 60; false -> Secs div 4 end,
    io:format("soak: ~b epochs of ~b s; memory compared from ~b s to the end~n",
              [Epochs, EpochS, T1]),
    S3 = leak(baseline(warm_recv_buffers(S2#{t1 => T1, mem_curve => []}))),
    Start = now_ms(),
    S4 = lists:foldl(fun(E, Acc) -> epoch(E, EpochS, Start, T1, Acc) end, S3,
                     lists:seq(1, Epochs)),
    S5 = final_checks(S4),
    S6 = memory_check(S5),
    S7 = teardown(S6),
    table(S7),
    case maps:get(failures, S7) of
        [] -> io:format("soak: PASS (seed ~b)~n", [Seed]), 0;
        Fs ->
            io:format("soak: FAIL (seed ~b): ~b failure(s)~n", [Seed, length(Fs)]),
            [io:format("  - ~ts~n", [F]) || F <- lists:reverse(Fs)],
            1
    end.

%% ===================================================================
%% Peers and the standalone pool node
%% ===================================================================

start_peer(I, #{prefix := Prefix, ledger := Ledger, incarnation := Inc0} = S) ->
    Name = list_to_atom(Prefix ++ "_p" ++ integer_to_list(I)),
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE, ap_test_util]]),
    %% Controlled over its standard_io (a hidden node cannot control a
    %% peer by distribution); it connects to this node for the ledger.
    %% SOAK_DIAG: allocations tagged by origin, for instrument:allocations/1.
    Tags = case diag_dir() of false -> []; _ -> ["+Muatags", "true"] end,
    {ok, Peer, Node} = peer:start(#{name => Name, connection => standard_io,
                                    args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                                             "-connect_all", "false",
                                             "-kernel", "prevent_overlapping_partitions", "false",
                                             %% Their logs come here: warnings and up.
                                             "-kernel", "logger_level", "warning"]
                                        ++ Tags ++ ["-pa" | Paths]}),
    unlink(Peer),
    Inject = case I of ?WITNESS -> inject(); _ -> none end,
    Info = peer:call(Peer, ?MODULE, peer_setup, [#{max_frame => ?MAX_FRAME, driver => node(), inject => Inject}],
                     60000),
    Inc = Inc0 + 1,
    Me = {I, Inc},
    W = peer:call(Peer, erlang, spawn, [?MODULE, worker, [Ledger, Me, rand:uniform(1 bsl 40), Inject]]),
    P = Info#{peer => Peer, node => Node, worker => W, me => Me, index => I},
    [put({os_pid, OP}, true) || OP <- os_pids(P)],
    ledger_cast(S, {alive, Me}),
    S#{peers := maps:put(I, P, maps:get(peers, S)), incarnation := Inc,
       pids := os_pids(P) ++ maps:get(pids, S)}.

os_pids(#{os_pid := B, pool_os_pid := PO, rcpt_os_pid := RO}) -> [B, PO, RO].

%% Every peer connected to the others (no global mesh: connect_all false).
mesh(#{peers := Peers}) ->
    Ps = maps:values(Peers),
    Nodes = [N || #{node := N} <- Ps],
    [true = peer:call(P, net_kernel, connect_node, [N], 30000)
     || #{peer := P, node := Self} <- Ps, N <- Nodes, N =/= Self],
    [wait_until(fun() ->
                        case peer:call(P, actor_receptionist, status, [], 30000) of
                            #{complete := true, members := M} -> M =:= lists:sort(Nodes -- [Self]);
                            _ -> false
                        end
                end, ?WAIT_MS) || #{peer := P, node := Self} <- Ps],
    ok.

-spec peer_setup(#{max_frame := pos_integer(), driver := node(), inject := inject()}) -> map().
peer_setup(#{max_frame := MF, driver := Driver, inject := Inject}) ->
    true = net_kernel:connect_node(Driver),
    ok = application:load(actor_pool),
    ok = application:set_env(actor_pool, gossip_interval_ms, 200),
    ok = application:set_env(actor_pool, receptionist_shm_mb, ?SHM_MB),
    ok = application:set_env(actor_pool, max_frame, MF),
    {ok, _} = application:ensure_all_started(actor_pool),
    {ok, _} = actor_pool:start_pool(soak_tell, echo, #{workers => 2}),
    {ok, _} = actor_pool:start_pool(soak_tell_dist, echo, #{workers => 1, fast_path => false}),
    {ok, _} = actor_pool:start_pool(soak_ask, echo,
                                    #{workers => 2,
                                      service_key => actor_receptionist:service_key(?ASK_KEY)}),
    AskDist = case Inject of
                  wrong_reply -> {plugin, ap_support:test_bin("plugin_misecho.so"), wrong};
                  late -> {plugin, ap_support:test_bin("plugin_misecho.so"), late};
                  _ -> echo
              end,
    {ok, _} = actor_pool:start_pool(soak_ask_dist, AskDist, #{workers => 1, fast_path => false}),
    #{os_pid := PO} = actor_cnode:info(actor_pool_node_owner),
    #{os_pid := RO} = actor_cnode:info(actor_receptionist_owner),
    #{pool_node => actor_pool:pool_node(), rcpt_node => actor_receptionist:receptionist_node(),
      os_pid => list_to_integer(os:getpid()), pool_os_pid => PO, rcpt_os_pid => RO}.

start_standalone(#{prefix := Prefix, cookie := Cookie} = S) ->
    [_, Host] = string:split(atom_to_list(node()), "@"),
    N = list_to_atom(Prefix ++ "_s@" ++ Host),
    Exe = filename:join(code:priv_dir(actor_pool), "actor_pool_node"),
    Args = ["--name", atom_to_list(N), "--cookie-file", Cookie, "--connect", atom_to_list(node()),
            "--max-frame", integer_to_list(?MAX_FRAME),
            "--pool", "soak_tell:echo:2", "--pool", "soak_ask:echo:2"],
    Self = self(),
    %% Its output is read (and dropped) by a process of its own, not left
    %% in the driver's mailbox; the process ends when the node does.
    Port = spawn(fun() ->
                         P = open_port({spawn_executable, Exe},
                                       [{args, Args}, exit_status, binary, stderr_to_stdout, use_stdio]),
                         {os_pid, Pid} = erlang:port_info(P, os_pid),
                         Self ! {standalone_os_pid, Pid},
                         drain(P)
                 end),
    OsPid = receive {standalone_os_pid, Pid} -> Pid after ?WAIT_MS -> error(standalone_not_started) end,
    put({os_pid, OsPid}, true),
    wait_until(fun() -> lists:member(N, nodes(hidden)) end, ?WAIT_MS),
    %% Its pools answer before the load uses them.
    wait_until(fun() -> gen_server:call({soak_ask, N}, {soak, up}, 1000) =:= {ok, {soak, up}} end,
               ?WAIT_MS),
    S#{standalone => #{node => N, port => Port, os_pid => OsPid},
       pids := [OsPid | maps:get(pids, S)]}.

%% The pool nodes' tell pools: {Name, PoolNode}, and what may fault them.
tell_pools(#{peers := Peers, standalone := #{node := SN}}) ->
    [{{Pn, PN}, {peer, I}} || {I, #{pool_node := PN}} <- maps:to_list(Peers),
                              Pn <- [soak_tell, soak_tell_dist]]
        ++ [{{soak_tell, SN}, standalone}].

ask_targets(#{peers := Peers, standalone := #{node := SN}}) ->
    [{Pn, PN} || #{pool_node := PN} <- maps:values(Peers), Pn <- [soak_ask, soak_ask_dist]]
        ++ [{soak_ask, SN}, {service_key, ?ASK_KEY}].

%% ===================================================================
%% Epochs
%% ===================================================================

epoch(E, EpochS, Start, _T1, S0) ->
    Targets = #{tells => [T || {T, _} <- tell_pools(S0)], asks => ask_targets(S0)},
    [W ! {resume, Targets} || #{worker := W} <- maps:values(maps:get(peers, S0))],
    EpochEnd = now_ms() + EpochS * 1000,
    %% The first epoch runs every fault once (in a seeded order), so that
    %% every code path ran before memory is first sampled; then at random.
    S1 = case E of
             1 -> chaos(E, EpochEnd, [F || {_, F} <- lists:sort([{rand:uniform(), F} || {F, _} <- ?FAULTS])],
                        S0#{faults := #{}});
             _ -> chaos(E, EpochEnd, [inject_reset || inject() =:= reset], S0#{faults := #{}})
         end,
    S2 = pause(E, S1),
    S3 = ask_check(E, tell_check(E, S2)),
    Elapsed = (now_ms() - Start) div 1000,
    M = sample_memory(S3#{epoch => E}),
    S3a = S3#{mem_curve => [{Elapsed, M} | maps:get(mem_curve, S3, [])]},
    %% C nodes restarted since: warmed now, compared from the next sample.
    S4 = warm_recv_buffers(S3a),
    io:format("soak: epoch ~b done at ~b s; faults ~p~n", [E, Elapsed, maps:keys(maps:get(faults, S4))]),
    S4.

%% Every worker finishes its operation and stops; one that does not within
%% an ask's timeout and margin (and some slack for a loaded machine) is a
%% caller that never got an answer.
pause(E, #{peers := Peers} = S) ->
    Tag = make_ref(),
    Ws = [{I, W} || {I, #{worker := W}} <- maps:to_list(Peers)],
    [W ! {pause, self(), Tag} || {_, W} <- Ws],
    Deadline = now_ms() + max(?ASK_TIMEOUT, ?REG_TIMEOUT) + ?ASK_MARGIN + 5000,
    lists:foldl(fun({I, W}, Acc) ->
                        receive {Tag, W} -> Acc
                        after max(0, Deadline - now_ms()) ->
                                fail(Acc, "epoch ~b: the worker on peer ~b did not finish its "
                                     "operation (an ask or a registration never answered)", [E, I])
                        end
                end, S, Ws).

%% Tells sent to each tell pool against what it processed (and counted as
%% dropped), on pool nodes that no fault touched this epoch.
tell_check(E, S) ->
    Sent = ledger_call(S, tells),
    Base = maps:get(tell_base, S, #{}),
    Faults = maps:get(faults, S),
    lists:foldl(
      fun({T, Who}, Acc) ->
              Clean = not maps:is_key(Who, Faults) andalso not maps:is_key(all, Faults)
                  andalso maps:is_key(T, Base),
              case Clean of
                  false ->
                      rebase(T, Sent, Acc);
                  true ->
                      {Sent0, Proc0, Drop0, Up0} = maps:get(T, Base),
                      Want = maps:get(T, Sent, 0) - Sent0,
                      case wait_processed(Acc, T, {Proc0, Drop0, Up0}, Want) of
                          {ok, Got, Drop, Up} ->
                              Acc1 = count(count(Acc, tells_checked, Want), tells_dropped_counted, Drop),
                              set_base(T, {maps:get(T, Sent, 0), Proc0 + Got, Drop0 + Drop, Up}, Acc1);
                          {lost, Got, Drop} ->
                              Acc1 = fail(Acc, "epoch ~b: ~p lost ~b tells: ~b sent, ~b processed, "
                                          "~b counted as dropped, no fault on its node",
                                          [E, T, Want - Got - Drop, Want, Got, Drop]),
                              rebase(T, Sent, Acc1);
                          {went_back, P, D, {UpNow, _, _}} ->
                              %% Only a fault starts a pool again, and none
                              %% touched its node: its tells are not
                              %% accounted for.
                              Acc1 = fail(Acc, "epoch ~b: ~p started again or its counters went back "
                                          "(uptime ~b ms, ~b ms after it was ~b; processed ~b -> ~b, "
                                          "dropped ~b -> ~b), no fault on its node",
                                          [E, T, UpNow, now_ms() - element(3, Up0), element(1, Up0),
                                           Proc0, P, Drop0, D]),
                              rebase(T, Sent, Acc1);
                          unreadable ->
                              Acc1 = fail(Acc, "epoch ~b: ~p's stats could not be read, no fault on its node",
                                          [E, T]),
                              rebase(T, Sent, Acc1)
                      end
              end
      end, S, tell_pools(S)).

%% Asks answered this epoch (a paused worker has reported all of its own):
%% none may bring back another message's payload, raise, or end later than
%% its timeout plus ?ASK_MARGIN, faults or not.
ask_check(E, S) ->
    #{counts := Counts, examples := Ex} = ledger_call(S, bad_asks),
    Seen = maps:get(bad_asks_seen, S, #{}),
    S1 = lists:foldl(
           fun({Kind, What}, Acc) ->
                   N = maps:get(Kind, Counts, 0) - maps:get(Kind, Seen, 0),
                   case N > 0 of
                       true -> fail(Acc, "epoch ~b: ~b ask(s) ~s; the last (path, what): ~0p",
                                    [E, N, What, lists:sublist(maps:get(Kind, Ex, []), min(N, 3))]);
                       false -> Acc
                   end
           end, S, [{wrong_reply, "answered with another message's payload"},
                    {raised, "raised an exception"},
                    {late, io_lib:format("ended over ~b ms after they were made", [?ASK_TIMEOUT + ?ASK_MARGIN])}]),
    S1#{bad_asks_seen => Counts}.

baseline(S) ->
    Sent = ledger_call(S, tells),
    lists:foldl(fun({T, _}, Acc) -> rebase(T, Sent, Acc) end, S, tell_pools(S)).

rebase(T, Sent, S) ->
    case settled_stats(S, T) of
        {ok, P, D, Up} -> set_base(T, {maps:get(T, Sent, 0), P, D, Up}, S);
        error -> S#{tell_base => maps:remove(T, maps:get(tell_base, S, #{}))}
    end.

set_base(T, V, S) ->
    S#{tell_base => maps:put(T, V, maps:get(tell_base, S, #{}))}.

%% Processed and dropped_tells once two reads 200 ms apart agree, and the
%% pool's uptime then ({UptimeMs, before, after the call that read it}).
settled_stats(S, T) ->
    settled_stats(S, T, undefined, 15).

settled_stats(_S, _T, _Prev, 0) -> error;
settled_stats(S, T, Prev, N) ->
    case pool_stats(S, T) of
        {ok, P, D, Up} when {P, D} =:= Prev -> {ok, P, D, Up};
        {ok, P, D, _} -> receive after 200 -> ok end, settled_stats(S, T, {P, D}, N - 1);
        error -> receive after 200 -> ok end, settled_stats(S, T, Prev, N - 1)
    end.

%% Until the pool has processed or dropped Want tells since the base: a
%% pool started again (its uptime grew less than the time since the base,
%% or a counter went back) is not that.
wait_processed(S, T, Base, Want) ->
    wait_processed(S, T, Base, Want, now_ms() + 10000, undefined).

wait_processed(S, T, {Proc0, Drop0, Up0} = Base, Want, Deadline, Last) ->
    case pool_stats(S, T) of
        {ok, P, D, Up} when P < Proc0; D < Drop0 -> {went_back, P, D, Up};
        {ok, P, D, {UpMs, Before, _} = Up}
          when UpMs + ?UPTIME_SLACK_MS < element(1, Up0) + Before - element(3, Up0) ->
            {went_back, P, D, Up};
        {ok, P, D, Up} when P - Proc0 + D - Drop0 >= Want -> {ok, P - Proc0, D - Drop0, Up};
        R ->
            case now_ms() >= Deadline of
                true ->
                    case R of
                        {ok, P, D, _} -> {lost, P - Proc0, D - Drop0};
                        error when Last =/= undefined -> {lost, element(1, Last) - Proc0,
                                                          element(2, Last) - Drop0};
                        error -> unreadable
                    end;
                false ->
                    receive after 100 -> ok end,
                    Last1 = case R of {ok, P, D, _} -> {P, D}; error -> Last end,
                    wait_processed(S, T, Base, Want, Deadline, Last1)
            end
    end.

pool_stats(#{peers := Peers}, {_, PN} = T) ->
    Via = case [P || #{pool_node := N, peer := P} <- maps:values(Peers), N =:= PN] of
              [Owner] -> Owner;
              [] -> maps:get(peer, hd(maps:values(Peers)))
          end,
    Before = now_ms(),
    case catch peer:call(Via, actor_pool, stats, [T], 10000) of
        #{processed := Proc, dropped_tells := D, uptime_ms := Up} -> {ok, Proc, D, {Up, Before, now_ms()}};
        _ -> error
    end.

%% ===================================================================
%% Chaos
%% ===================================================================


%% Faults at random intervals (0.5-3 s) until the epoch's end (those queued
%% first); each is run to its end (a killed node is back) before the next.
chaos(E, EpochEnd, Queue, S) ->
    Gap = 500 + rand:uniform(2500),
    case Queue =/= [] orelse now_ms() + Gap + 1000 < EpochEnd of
        false ->
            receive after max(0, EpochEnd - now_ms()) -> ok end,
            S;
        true ->
            receive after Gap -> ok end,
            {F, Rest} = case Queue of
                            [F0 | R0] -> {F0, R0};
                            [] -> {pick_weighted(?FAULTS), []}
                        end,
            S1 = try fault(F, S)
                 catch C:R:St ->
                         fail(S, "epoch ~b: fault ~p could not be run: ~p:~p ~p", [E, F, C, R, St])
                 end,
            chaos(E, EpochEnd, Rest, count(S1, {fault, F}, 1))
    end.

pick_weighted(L) ->
    N = rand:uniform(lists:sum([W || {_, W} <- L])),
    pick_weighted(L, N).

pick_weighted([{F, W} | _], N) when N =< W -> F;
pick_weighted([{_, W} | T], N) -> pick_weighted(T, N - W).

random_peer(#{peers := Peers}) ->
    Is = lists:sort(maps:keys(Peers)),
    I = lists:nth(rand:uniform(length(Is)), Is),
    {I, maps:get(I, Peers)}.

%% A peer to kill, or whose C node to kill: never peer 1, the memory
%% witness (its BEAM and C nodes live from the first memory sample to the
%% end, so that growth is measured on them; they get every other fault).
random_victim(#{peers := Peers} = S) ->
    random_peer(S#{peers := maps:remove(?WITNESS, Peers)}).

touched(Who, S) -> S#{faults := maps:put(Who, true, maps:get(faults, S))}.

%% SOAK_INJECT=reset: the witness's soak_tell pool starts again (its
%% counters from 0), and nothing says so: the tell check must fail.
fault(inject_reset, #{peers := #{?WITNESS := #{peer := P}}} = S) ->
    ok = peer:call(P, actor_pool, stop_pool, [soak_tell], 30000),
    {ok, _} = peer:call(P, actor_pool, start_pool, [soak_tell, echo, #{workers => 2}], 30000),
    S;
fault(kill_pool_cnode, S0) ->
    {I, #{peer := P} = Pe} = random_victim(S0),
    Old = maps:get(pool_os_pid, Pe),
    R0 = restarts(P, actor_pool_node_owner),
    kill(Old),
    New = wait_cnode_up(P, actor_pool_node_owner, Old),
    %% One new incarnation: the first one got ready (its busy BEAM may
    %% reach it before it reaches its BEAM).
    S = expect(S0, pool_cnode_back_in_one_restart, restarts(P, actor_pool_node_owner) - R0,
               fun(N) -> N =:= 1 end),
    %% The keeper starts its pools again: wait for them.
    wait_until(fun() -> length(catch peer:call(P, actor_pool, which_pools, [], 10000)) =:= 4 end,
               ?WAIT_MS),
    S1 = touched({peer, I}, S),
    S1#{peers := maps:put(I, Pe#{pool_os_pid := New}, maps:get(peers, S1)),
        pids := [New | maps:get(pids, S1)]};
fault(kill_rcpt_cnode, S0) ->
    {I, #{peer := P} = Pe} = random_victim(S0),
    Old = maps:get(rcpt_os_pid, Pe),
    R0 = restarts(P, actor_receptionist_owner),
    kill(Old),
    New = wait_cnode_up(P, actor_receptionist_owner, Old),
    S = expect(S0, rcpt_cnode_back_in_one_restart, restarts(P, actor_receptionist_owner) - R0,
               fun(N) -> N =:= 1 end),
    %% Registrations are replayed by its BEAM: no pool node is touched.
    S#{peers := maps:put(I, Pe#{rcpt_os_pid := New}, maps:get(peers, S)),
       pids := [New | maps:get(pids, S)]};
fault(kill_peer, S) ->
    {I, #{os_pid := OsPid, me := Me, peer := Peer}} = random_victim(S),
    kill(OsPid),
    wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
    catch peer:stop(Peer),
    ledger_cast(S, {dead, Me}),
    %% Tells it sent just before may die in its buffers: no pool is
    %% checked this epoch.
    S1 = touched(all, touched({peer, I}, S)),
    S2 = S1#{peers := maps:remove(I, maps:get(peers, S1))},
    %% Same name again once its old names left epmd (its C nodes exit when
    %% their ports close).
    #{prefix := Prefix} = S2,
    Alive = Prefix ++ "_p" ++ integer_to_list(I),
    wait_until(fun() -> not lists:any(fun(N) -> lists:prefix(Alive, N) end, epmd_names()) end,
               ?WAIT_MS),
    S3 = start_peer(I, S2),
    mesh(S3),
    #{worker := W} = maps:get(I, maps:get(peers, S3)),
    W ! {resume, #{tells => [T || {T, _} <- tell_pools(S3)], asks => ask_targets(S3)}},
    S3;
fault(kill_standalone, #{standalone := #{os_pid := OsPid, node := N}} = S) ->
    kill(OsPid),
    wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
    wait_until(fun() -> not lists:member(N, nodes(hidden)) end, ?WAIT_MS),
    [Alive, _] = string:split(atom_to_list(N), "@"),
    wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS),
    start_standalone(touched(standalone, S));
fault(oversized, S) ->
    {_, #{peer := P, pool_node := PN}} = random_peer(S),
    Big = binary:copy(<<"x">>, ?MAX_FRAME + 4096),
    %% Through the library, to its own pools that do not take the ring (a
    %% ring record may hold more than a frame): refused before anything is
    %% sent.
    O0 = peer:call(P, actor_pool, oversized, [], 10000),
    R1 = peer:call(P, actor_pool, ask, [{soak_ask_dist, PN}, Big, ?ASK_TIMEOUT], 30000),
    ok = peer:call(P, actor_pool, tell, [{soak_tell_dist, PN}, Big], 30000),
    O1 = peer:call(P, actor_pool, oversized, [], 10000),
    S1 = expect(S, oversized_ask_by_library, R1, fun({error, {too_large, _, _}}) -> true; (_) -> false end),
    S2 = expect(S1, oversized_tell_counted, {O0, O1},
                fun({#{tells := T0, asks := A0}, #{tells := T1, asks := A1}}) ->
                        T1 =:= T0 + 1 andalso A1 =:= A0 + 1
                end),
    %% From this BEAM, which never started the library: the C node
    %% answers the call and keeps the connection.
    R2 = catch gen_server:call({soak_ask, PN}, Big, 30000),
    expect(S2, oversized_call_plain_beam, R2, fun(R) -> R =:= {error, too_large} end);
fault(malformed, #{standalone := #{node := SN, os_pid := SPid}} = S) ->
    {_, #{pool_node := PN, rcpt_node := RN, pool_os_pid := PPid, rcpt_os_pid := RPid}} = random_peer(S),
    {To, Name, OsPid, Msg} =
        case rand:uniform(3) of
            1 -> {PN, soak_ask, PPid, cast_msg()};
            2 -> {SN, soak_ask, SPid, cast_msg()};
            3 -> {RN, actor_receptionist, RPid, send_msg(self_name(S))}
        end,
    {State, _Got} = rawpeer_once(S, To, ap_test_util:reg_send_frame(self_name(S), Name, Msg)),
    S1 = expect(S, malformed_closes_only_its_connection, State, fun(St) -> St =:= "closed" end),
    expect(S1, malformed_node_survives, OsPid, fun os_pid_alive/1);
fault(idle_clients, S) ->
    {To, OsPid} = random_cnode(S),
    Port = dist_port(To),
    Socks = [Sock || _ <- lists:seq(1, 30),
                     {ok, Sock} <- [gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, false}], 5000)]],
    receive after 2000 -> ok end,
    [gen_tcp:close(Sock) || Sock <- Socks],
    count(expect(S, idle_clients_node_survives, OsPid, fun os_pid_alive/1), idle_clients, length(Socks));
fault(slow_clients, S) ->
    {To, OsPid} = random_cnode(S),
    %% A frame announced at 512 KiB, of which a few bytes come.
    Hex = "00080000" ++ "70" ++ "8368046400",
    Peers = [rawpeer_hold(S, To, Hex) || _ <- lists:seq(1, 5)],
    Lines = [await_port_line(P) || P <- Peers],
    receive after 2000 -> ok end,
    [stop_port(P) || P <- Peers],
    S1 = S#{pids := [Pid || {_, Pid} <- Peers] ++ maps:get(pids, S)},
    S2 = expect(S1, slow_clients_connected, Lines, fun(L) -> lists:all(fun(X) -> X =:= "sent" end, L) end),
    expect(S2, slow_clients_node_survives, OsPid, fun os_pid_alive/1);
fault(netns_cut, #{netns := {skip, _}} = S) ->
    count(S, netns_cut_skipped, 1);
fault(netns_cut, S) ->
    netns_cut(S).

expect(S, What, Got, Pred) ->
    case Pred(Got) of
        true -> count(S, {ok, What}, 1);
        false -> fail(count(S, {bad, What}, 1), "~p: got ~0p", [What, Got])
    end.

restarts(P, Owner) ->
    #{restarts := R} = peer:call(P, actor_cnode, info, [Owner], 10000),
    R.

wait_cnode_up(P, Owner, Old) ->
    wait_until(fun() ->
                       case catch peer:call(P, actor_cnode, info, [Owner], 10000) of
                           #{status := up, os_pid := New} -> New =/= Old;
                           _ -> false
                       end
               end, ?WAIT_MS),
    #{os_pid := New} = peer:call(P, actor_cnode, info, [Owner], 10000),
    New.

random_cnode(#{standalone := #{node := SN, os_pid := SPid}} = S) ->
    {_, #{pool_node := PN, rcpt_node := RN, pool_os_pid := PPid, rcpt_os_pid := RPid}} = random_peer(S),
    lists:nth(rand:uniform(3), [{PN, PPid}, {RN, RPid}, {SN, SPid}]).

dist_port(Node) ->
    [Alive, Host] = string:split(atom_to_list(Node), "@"),
    {port, Port, _} = erl_epmd:port_please(Alive, Host),
    Port.

%% ===================================================================
%% Network namespaces: a link cut between two members of their own
%% ===================================================================

%% Two namespaces linked by a veth pair, each running a BEAM with the
%% application (controlled over its standard_io): each registers a process,
%% the link goes down for a few seconds (each side's view drops the other's
%% registration once distribution notices), comes back, and both views must
%% converge to both registrations again. Needs root and iproute2, like the
%% cluster suite's cut.
netns_check() ->
    case {os:getenv("USER"), string:trim(os:cmd("id -u"))} of
        {_, "0"} ->
            case os:find_executable("ip") of
                false -> {skip, "no ip(8) (iproute2)"};
                _ ->
                    Ns = "apsoakchk" ++ os:getpid(),
                    case string:trim(os:cmd("ip netns add " ++ Ns ++ " 2>&1 && ip netns del " ++ Ns ++ " 2>&1 && echo ok")) of
                        "ok" -> ok;
                        Out -> {skip, "ip netns add fails: " ++ Out}
                    end
            end;
        _ ->
            {skip, "not root (network namespaces need root)"}
    end.

netns_cut(S) ->
    Tag = integer_to_list(list_to_integer(os:getpid()) rem 100000),
    Ns = ["apsoak" ++ Tag ++ X || X <- ["a", "b"]],
    Addr = fun(1) -> "10.77.0.1"; (2) -> "10.77.0.2" end,
    {DevA, DevB} = {"aps" ++ Tag ++ "a", "aps" ++ Tag ++ "b"},
    try
        [sh("ip netns add " ++ N) || N <- Ns],
        [begin sh(in(N, "ip link set lo up")) end || N <- Ns],
        sh("ip link add " ++ DevA ++ " type veth peer name " ++ DevB),
        sh("ip link set " ++ DevA ++ " netns " ++ hd(Ns)),
        sh("ip link set " ++ DevB ++ " netns " ++ lists:last(Ns)),
        sh(in(hd(Ns), "ip addr add " ++ Addr(1) ++ "/24 dev " ++ DevA)),
        sh(in(lists:last(Ns), "ip addr add " ++ Addr(2) ++ "/24 dev " ++ DevB)),
        Link = fun(UD) -> sh(in(hd(Ns), "ip link set " ++ DevA ++ " " ++ UD)),
                          sh(in(lists:last(Ns), "ip link set " ++ DevB ++ " " ++ UD))
               end,
        Link("up"),
        [A, B] = Ms = [netns_member(N, Addr(I)) || {I, N} <- lists:zip([1, 2], Ns)],
        try
            true = peer:call(A, net_kernel, connect_node, [peer:call(B, erlang, node, [])]),
            K = actor_receptionist:service_key(<<"soak.netns">>),
            Refs = [peer:call(M, erlang, spawn, [timer, sleep, [infinity]]) || M <- Ms],
            [ok = peer:call(M, actor_receptionist, register, [K, R]) || {M, R} <- lists:zip(Ms, Refs)],
            Want = lists:sort(Refs),
            Conv = fun(W) -> fun() -> lists:all(fun(M) -> lists:sort(peer:call(M, actor_receptionist, lookup, [K])) =:= W end, Ms) end end,
            S1 = converge_or_fail(S, netns_before_cut, Conv(Want)),
            Link("down"),
            [RA, RB] = Refs,
            %% Distribution notices by its ticks (net_ticktime 2 s here).
            S2 = converge_or_fail(S1, netns_cut_seen,
                                  fun() -> peer:call(A, actor_receptionist, lookup, [K]) =:= [RA]
                                               andalso peer:call(B, actor_receptionist, lookup, [K]) =:= [RB]
                                  end),
            Link("up"),
            true = peer:call(A, net_kernel, connect_node, [peer:call(B, erlang, node, [])]),
            converge_or_fail(count(S2, netns_cuts, 1), netns_healed, Conv(Want))
        after
            [begin catch peer:call(M, application, stop, [actor_pool]), catch peer:stop(M) end || M <- Ms]
        end
    after
        [begin
             Pids = string:lexemes(os:cmd("ip netns pids " ++ N ++ " 2>/dev/null"), "\n"),
             _ = [os:cmd("kill -9 " ++ P) || P <- Pids],
             os:cmd("ip netns del " ++ N ++ " 2>/dev/null")
         end || N <- Ns]
    end.

converge_or_fail(S, What, Fun) ->
    try wait_until(Fun, ?CONVERGE_MS) of
        ok -> count(S, {ok, What}, 1)
    catch error:_ -> fail(S, "network cut: ~p not reached in ~b ms", [What, ?CONVERGE_MS])
    end.

netns_member(Ns, Addr) ->
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE, ap_test_util]]),
    {ok, Peer, _} =
        peer:start(#{name => list_to_atom(Ns), host => Addr, longnames => true,
                     exec => {os:find_executable("ip"), ["netns", "exec", Ns, os:find_executable("erl")]},
                     connection => standard_io,
                     args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                              "-connect_all", "false",
                              "-kernel", "prevent_overlapping_partitions", "false",
                              "-kernel", "net_ticktime", "2", "-pa" | Paths]}),
    unlink(Peer),
    ok = peer:call(Peer, application, load, [actor_pool]),
    ok = peer:call(Peer, application, set_env, [actor_pool, pool_node, false]),
    ok = peer:call(Peer, application, set_env, [actor_pool, gossip_interval_ms, 200]),
    ok = peer:call(Peer, application, set_env, [actor_pool, receptionist_shm_mb, ?SHM_MB]),
    {ok, _} = peer:call(Peer, application, ensure_all_started, [actor_pool], 60000),
    Peer.

in(Ns, Cmd) -> "ip netns exec " ++ Ns ++ " " ++ Cmd.

sh(Cmd) ->
    Out = string:trim(os:cmd(Cmd ++ " 2>&1; echo \"rc=$?\"")),
    case lists:suffix("rc=0", Out) of
        true -> ok;
        false -> error({command_failed, Cmd, Out})
    end.

%% ===================================================================
%% Crafted input (the security suite's reproducers) and raw clients
%% ===================================================================

self_name(#{prefix := Prefix}) ->
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Prefix ++ "_raw@" ++ Host.

%% {'$gen_cast', {Fun, Pad}}: a fun whose Size overruns into a binary
%% header claiming 256 MiB (actor_security_term_tests).
cast_msg() ->
    <<131, 104, 2, (ap_test_util:ext_atom('$gen_cast'))/binary, 104, 2, (ap_test_util:fun_overrun(256 * 1024 * 1024))/binary>>.

%% {send, Pid, {Fun, Pad}} to the receptionist node's process.
send_msg(Self) ->
    <<131, 104, 3, (ap_test_util:ext_atom(send))/binary, (ap_test_util:ext_pid(Self))/binary, 104, 2,
      (ap_test_util:fun_overrun(256 * 1024 * 1024))/binary>>.

rawpeer_exe() -> ap_support:test_bin("actor_rawpeer").

rawpeer_once(#{cookie := Cookie} = S, Node, Frame) ->
    Port = open_port({spawn_executable, rawpeer_exe()},
                     [{args, ["-N", self_name(S), "-m", "00", atom_to_list(Node), Cookie, hex(Frame)]},
                      exit_status, binary, use_stdio]),
    {os_pid, OsPid} = erlang:port_info(Port, os_pid),
    put(rawpeer_pids, [OsPid | case get(rawpeer_pids) of undefined -> []; L -> L end]),
    {0, Out} = collect(Port, <<>>, now_ms() + 20000, OsPid),
    [State, Got | _] = string:lexemes(lists:last(string:lexemes(binary_to_list(Out), "\r\n")), " "),
    {State, list_to_integer(Got)}.

hex(Bin) -> binary_to_list(binary:encode_hex(Bin)).

collect(Port, Acc, Deadline, OsPid) ->
    receive
        {Port, {data, D}} -> collect(Port, <<Acc/binary, D/binary>>, Deadline, OsPid);
        {Port, {exit_status, St}} -> {St, Acc}
    after max(0, Deadline - now_ms()) ->
            kill(OsPid),
            catch port_close(Port),
            error({rawpeer_timeout, Acc})
    end.

rawpeer_hold(#{cookie := Cookie}, Node, Hex) ->
    Port = open_port({spawn_executable, rawpeer_exe()},
                     [{args, [atom_to_list(Node), Cookie, Hex, "hold"]},
                      {line, 256}, binary, exit_status, use_stdio]),
    {os_pid, OsPid} = erlang:port_info(Port, os_pid),
    {Port, OsPid}.

await_port_line({Port, _}) ->
    receive
        {Port, {data, {eol, Line}}} -> binary_to_list(Line);
        {Port, {exit_status, St}} -> {exited, St}
    after ?WAIT_MS -> timeout
    end.

stop_port({Port, OsPid}) ->
    catch port_close(Port),
    wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
    flush_port(Port).

drain(Port) ->
    receive
        {Port, {exit_status, _}} -> ok;
        {Port, _} -> drain(Port)
    end.

flush_port(Port) ->
    receive {Port, _} -> flush_port(Port) after 0 -> ok end.

%% ===================================================================
%% Load (on the peers)
%% ===================================================================

%% The load of one peer: one operation every few ms while resumed.
-spec worker(pid(), {pos_integer(), pos_integer()}, integer(), inject()) -> no_return().
worker(Ledger, Me, Seed, Inject) ->
    rand:seed(exsss, Seed),
    Refs = [spawn(timer, sleep, [infinity]) || _ <- lists:seq(1, 6)],
    Sub = spawn(fun() -> subscriber(#{}) end),
    [ok = actor_receptionist:subscribe(K, Sub) || K <- keys()],
    paused(#{ledger => Ledger, me => Me, refs => Refs, sub => Sub, regs => #{}, n => 0, inject => Inject}).

paused(W) ->
    receive
        {resume, Targets} -> running(W#{t => Targets});
        {pause, From, Tag} -> From ! {Tag, self()}, paused(W);
        {state, From, Tag} -> From ! {Tag, state(W)}, paused(W)
    end.

running(W) ->
    receive
        {pause, From, Tag} -> From ! {Tag, self()}, paused(W);
        {resume, Targets} -> running(W#{t => Targets})
    after ?PACE_MS ->
            running(op(pick_weighted([{tell, 50}, {ask, 30}, {reg, 8}, {dereg, 8}, {sub, 4}]), W))
    end.

state(#{sub := Sub, regs := Regs}) ->
    Sub ! {listings, self()},
    Ls = receive {Sub, L} -> L after 10000 -> timeout end,
    #{listings => Ls, regs => Regs}.

op(tell, #{t := #{tells := Ts}, ledger := L, me := Me} = W) ->
    T = pick(Ts),
    ok = actor_pool:tell(T, <<"t">>),
    L ! {tell, Me, T},
    W;
op(ask, #{t := #{asks := As}, ledger := L, me := Me, n := N, inject := Inject} = W) ->
    T = case pick(As) of {service_key, Id} -> actor_receptionist:service_key(Id); X -> X end,
    {Msg, Timeout} = injected(Inject, T, N),
    T0 = erlang:monotonic_time(millisecond),
    R = try actor_pool:ask(T, Msg, Timeout)
        catch C:E -> {raised, C, E}
        end,
    D = erlang:monotonic_time(millisecond) - T0,
    Kind = case R of
               {ok, Msg} -> ok;
               {ok, _} -> wrong_reply;
               {error, {nodedown, _}} -> nodedown;
               {error, {Why, _, _}} -> Why;
               {error, Why} when is_atom(Why) -> Why;
               {error, _} -> other_error;
               _ -> raised
           end,
    L ! {ask, Me, path(T), Kind, D, {Msg, R}},
    W#{n := N + 1};
op(reg, #{refs := Refs, regs := Regs, ledger := L, me := Me} = W) ->
    K = pick(keys()), R = pick(Refs),
    case maps:is_key({K, R}, Regs) of
        true -> W;
        false ->
            Res = sync(register, K, R),
            L ! {reg, Me, K, R, Res},
            W#{regs := maps:put({K, R}, Res, Regs)}
    end;
op(dereg, #{regs := Regs, ledger := L, me := Me} = W) when map_size(Regs) > 0 ->
    {K, R} = pick(maps:keys(Regs)),
    Res = sync(deregister, K, R),
    L ! {dereg, Me, K, R, Res},
    W#{regs := case Res of acked -> maps:remove({K, R}, Regs); _ -> maps:put({K, R}, unsure, Regs) end};
op(dereg, W) ->
    W;
op(sub, #{sub := Sub, ledger := L, me := Me} = W) ->
    ok = actor_receptionist:subscribe(pick(keys()), Sub),
    L ! {sub, Me},
    W.

%% A (de)registration and its acknowledgement, through a relay whose exit
%% carries the result (a late or repeated ack dies with it).
sync(Op, K, R) ->
    {Relay, Mref} = spawn_monitor(fun() ->
                                          ok = actor_receptionist:Op(K, R, self()),
                                          receive
                                              {registered, K, R} -> exit(acked);
                                              {deregistered, K, R} -> exit(acked);
                                              {register_failed, K, R, _} -> exit(failed)
                                          end
                                  end),
    receive {'DOWN', Mref, process, Relay, Res} -> res(Res)
    after ?REG_TIMEOUT ->
            exit(Relay, kill),
            erlang:demonitor(Mref, [flush]),
            unsure
    end.

res(acked) -> acked;
res(failed) -> failed;
res(_) -> unsure.

path({service_key, _}) -> by_key;
path({soak_ask_dist, _}) -> dist_own;
path({soak_ask, N}) ->
    case lists:prefix("soak", atom_to_list(N)) andalso lists:suffix("_s", hd(string:split(atom_to_list(N), "@"))) of
        true -> standalone;
        false -> same_host
    end.

keys() -> [actor_receptionist:service_key(K) || K <- ?KEYS].

%% The message and timeout of the worker's Nth ask to T: {soak, N} within
%% ?ASK_TIMEOUT, unless SOAK_INJECT says otherwise for the witness.
injected(raise, _T, N) when N rem 100 =:= 99 ->
    {{soak, N, fun() -> N end}, ?ASK_TIMEOUT};
injected(late, {soak_ask_dist, _}, N) ->
    {{soak, N}, 4 * ?ASK_TIMEOUT};
injected(_, _T, N) ->
    {{soak, N}, ?ASK_TIMEOUT}.

%% SOAK_INJECT (see the top), checked when the run starts.
-type inject() :: none | wrong_reply | raise | late | reset.
inject() ->
    case os:getenv("SOAK_INJECT", "") of
        "" -> none;
        "wrong_reply" -> wrong_reply;
        "raise" -> raise;
        "late" -> late;
        "reset" -> reset;
        Other -> error({bad_soak_inject, Other, "want wrong_reply, raise, late or reset"})
    end.

pick(L) -> lists:nth(rand:uniform(length(L)), L).

subscriber(Last) ->
    receive
        {listing, K, Refs} -> subscriber(maps:put(K, lists:sort(Refs), Last));
        {listings, From} -> From ! {self(), Last}, subscriber(Last);
        _ -> subscriber(Last)
    end.

%% ===================================================================
%% Ledger (on this node)
%% ===================================================================

ledger(L) ->
    receive
        {tell, Me, T} -> ledger(live(Me, L, fun(L1) -> incr(L1, {tell, T}, 1) end));
        {ask, Me, Path, Kind, D, Detail} ->
            ledger(live(Me, L, fun(L1) ->
                                       L2 = incr(L1, {ask, Path, Kind}, 1),
                                       L3 = case Kind of
                                                wrong_reply -> bad_ask(L2, wrong_reply, {Path, Detail});
                                                raised -> bad_ask(L2, raised, {Path, Detail});
                                                _ -> L2
                                            end,
                                       case D > ?ASK_TIMEOUT + ?ASK_MARGIN of
                                           true -> bad_ask(incr(L3, {late_ask, Path}, 1), late, {Path, D});
                                           false -> L3
                                       end
                               end));
        {reg, Me, K, R, Res} ->
            ledger(live(Me, L, fun(L1) -> model(incr(L1, {reg, Res}, 1), {K, R}, {Me, Res}) end));
        {dereg, Me, K, R, Res} ->
            ledger(live(Me, L, fun(L1) ->
                                       L2 = incr(L1, {dereg, Res}, 1),
                                       case Res of
                                           acked -> L2#{regs => maps:remove({K, R}, maps:get(regs, L2, #{}))};
                                           _ -> model(L2, {K, R}, {Me, unsure})
                                       end
                               end));
        {sub, Me} -> ledger(live(Me, L, fun(L1) -> incr(L1, sub, 1) end));
        {alive, Me} -> ledger(L#{alive => [Me | maps:get(alive, L, [])]});
        {dead, {I, _} = Me} ->
            Regs = maps:filter(fun(_, {{I2, _}, _}) -> I2 =/= I end, maps:get(regs, L, #{})),
            ledger(L#{alive => maps:get(alive, L, []) -- [Me], regs => Regs});
        {get, From, Tag, What} -> From ! {Tag, get(What, L)}, ledger(L)
    end.

%% Reports of a dead incarnation (in flight when it was killed) are dropped.
live(Me, L, Fun) ->
    case lists:member(Me, maps:get(alive, L, [])) of
        true -> Fun(L);
        false -> incr(L, dropped_report_of_dead_peer, 1)
    end.

model(L, KR, V) -> L#{regs => maps:put(KR, V, maps:get(regs, L, #{}))}.

incr(L, K, N) -> L#{counts => maps:update_with(K, fun(V) -> V + N end, N, maps:get(counts, L, #{}))}.

%% An ask the checks fail on: counted by kind, the last few kept.
bad_ask(L, Kind, Example) ->
    #{counts := C, examples := Ex} = Bad = maps:get(bad_asks, L, #{counts => #{}, examples => #{}}),
    L#{bad_asks => Bad#{counts := maps:update_with(Kind, fun(V) -> V + 1 end, 1, C),
                        examples := Ex#{Kind => lists:sublist([Example | maps:get(Kind, Ex, [])], 3)}}}.

get(tells, L) -> maps:from_list([{T, N} || {{tell, T}, N} <- maps:to_list(maps:get(counts, L, #{}))]);
get(counts, L) -> maps:get(counts, L, #{});
get(regs, L) -> maps:get(regs, L, #{});
get(bad_asks, L) -> maps:get(bad_asks, L, #{counts => #{}, examples => #{}}).

ledger_call(#{ledger := L}, What) ->
    Tag = make_ref(),
    L ! {get, self(), Tag, What},
    receive {Tag, V} -> V after 30000 -> error(ledger_timeout) end.

ledger_cast(#{ledger := L}, Msg) -> L ! Msg, ok.

%% ===================================================================
%% Final checks
%% ===================================================================

final_checks(S) ->
    Regs = ledger_call(S, regs),
    Peers = maps:values(maps:get(peers, S)),
    Want = fun(K) -> lists:sort([R || {{K2, R}, {_, acked}} <- maps:to_list(Regs), K2 =:= K]) end,
    Unsure = fun(K) -> [R || {{K2, R}, {_, Res}} <- maps:to_list(Regs), K2 =:= K, Res =/= acked] end,
    Check = fun() ->
                    [{Node, K, Missing, Stale}
                     || #{peer := P, node := Node} <- Peers, K <- keys(),
                        Have <- [lists:sort(peer:call(P, actor_receptionist, lookup, [K], 10000))],
                        Missing <- [Want(K) -- Have], Stale <- [Have -- Want(K) -- Unsure(K)],
                        Missing =/= [] orelse Stale =/= []]
            end,
    Bad = converge(Check),
    S1 = count(S, regs_checked, length(Peers) * lists:sum([length(Want(K)) || K <- keys()])),
    S2 = lists:foldl(fun({Node, K, M, St}, Acc) ->
                             fail(Acc, "~p on ~p: ~b acknowledged registrations missing ~0p, ~b stale ~0p",
                                  [K, Node, length(M), M, length(St), St])
                     end, S1, Bad),
    %% Each subscriber's last listing is the lookup of its node.
    SubCheck = fun() ->
                       [{Node, K, Last, Have}
                        || #{peer := P, node := Node, worker := W} <- Peers,
                           #{listings := Ls} <- [worker_state(P, W)], K <- keys(),
                           Have <- [lists:sort(peer:call(P, actor_receptionist, lookup, [K], 10000))],
                           Last <- [maps:get(K, Ls, none)], Last =/= Have]
               end,
    BadSubs = converge(SubCheck),
    S3 = count(S2, subscriptions_checked, length(Peers) * length(keys())),
    lists:foldl(fun({Node, K, Last, Have}, Acc) ->
                        fail(Acc, "subscriber on ~p: last listing of ~p is ~0p, lookup ~0p",
                             [Node, K, Last, Have])
                end, S3, BadSubs).

converge(Check) ->
    Deadline = now_ms() + ?CONVERGE_MS,
    converge(Check, Deadline).

converge(Check, Deadline) ->
    case Check() of
        [] -> [];
        Bad ->
            case now_ms() >= Deadline of
                true -> Bad;
                false -> receive after 200 -> ok end, converge(Check, Deadline)
            end
    end.

worker_state(P, W) ->
    Tag = make_ref(),
    peer:call(P, erlang, send, [W, {state, self(), Tag}]),
    receive {Tag, St} -> St after 30000 -> #{listings => #{}} end.

%% ===================================================================
%% Memory
%% ===================================================================

%% {What, OsPid} => bytes: each peer BEAM's erlang:memory/0 and each C
%% node's VmRSS, RssAnon and RssShmem. Each value is the least of
%% ?MEM_SAMPLES samples taken ?MEM_GAP_MS apart (the peers in parallel, the
%% C nodes' /proc read at each step): on a BEAM, each sample after its
%% mailboxes drained and every process was garbage collected
%% (settled_memory/2). What is transient at the pause (a peer's `system'
%% 2 to 10 MiB higher in the first sample after the load stops, gone
%% 500 ms later: see memory_check/1) is missing from at least one sample;
%% what is kept is in all of them.
sample_memory(#{peers := Peers, standalone := #{node := SN, os_pid := SPid}} = S) ->
    Self = self(),
    Diag = diag_dir(),
    Calls = [{spawn_link(fun() ->
                                 R = peer:call(P, ?MODULE, settled_memory,
                                               [?MEM_SAMPLES, ?MEM_GAP_MS], 120000),
                                 Self ! {self(), R}
                         end), N, B}
             || #{peer := P, node := N, os_pid := B} <- maps:values(Peers)],
    CNodes = [{SN, SPid} | lists:append([[{PN, PO}, {RN, RO}]
                                         || #{pool_node := PN, pool_os_pid := PO,
                                              rcpt_node := RN, rcpt_os_pid := RO} <- maps:values(Peers)])],
    RssSamples = [begin
                      I > 1 andalso receive after ?MEM_GAP_MS -> true end,
                      lists:append([rss_rows(N, P) || {N, P} <- CNodes])
                  end || I <- lists:seq(1, ?MEM_SAMPLES)],
    Beams = [receive {Pid, R} -> {N, B, R} end || {Pid, N, B} <- Calls],
    Diag =/= false andalso
        file:write_file(filename:join(Diag, io_lib:format("epoch~3..0b.bin", [maps:get(epoch, S, 0)])),
                        term_to_binary(Beams)),
    maps:from_list(lists:append([beam_rows(N, B, R) || {N, B, R} <- Beams])
                   ++ floor_rows(RssSamples)).

%% RSS values: per C node, the least over the samples of its incarnation
%% alive at the last one (a process gone from /proc reads 0, not counted).
%% The mappings (shm_maps, shm_mapped) as of the last sample: their bound
%% holds at every sample, not at the least.
floor_rows(Samples) ->
    Floor = fun(K, Pid, V0) ->
                    case [V || Smp <- Samples, {K2, {P2, V}} <- Smp, K2 =:= K, P2 =:= Pid, V > 0] of
                        [] -> V0;
                        Vs -> lists:min(Vs)
                    end
            end,
    [case K of
         {R, _} when R =:= rss; R =:= rss_anon; R =:= rss_shmem -> {K, {Pid, Floor(K, Pid, V)}};
         _ -> Row
     end || {K, {Pid, V}} = Row <- lists:last(Samples)].

%% SOAK_DIAG=DIR: each epoch end's samples, with their breakdown (diag/0),
%% go to DIR/epochNNN.bin (term_to_binary), to tell what moved.
diag_dir() ->
    case os:getenv("SOAK_DIAG") of
        false -> false;
        "" -> false;
        D -> ok = filelib:ensure_dir(filename:join(D, "x")), D
    end.

%% A C node on io_uring receives into a pool of 64 buffers of 64 KiB,
%% taken in turn, whose pages the kernel touches only as it fills them:
%% RssAnon creeps up to the pool's 4 MiB over minutes of small reads (the
%% 300 s curves: a pool node's 4 MiB mapping holding distribution traffic,
%% 1.2 -> 1.9 -> 3.4 MiB touched, flat after). Before memory is sampled,
%% each C node reads 8 oversized frames (discarded, each skipped in full
%% buffers), so that every buffer of the pool was filled once; a C node
%% restarted later is warmed at the next epoch end and compared only from
%% the sample after that.
warm_recv_buffers(#{peers := Peers, standalone := #{node := SN, os_pid := SPid}} = S) ->
    Warmed = maps:get(warmed, S, #{}),
    After = length(maps:get(mem_curve, S, [])),
    New = [{N, P} || {N, P} <- [{SN, SPid}
                                | lists:append([[{PN, PO}, {RN, RO}]
                                                || #{pool_node := PN, pool_os_pid := PO,
                                                     rcpt_node := RN, rcpt_os_pid := RO} <- maps:values(Peers)])],
                     not maps:is_key(P, Warmed)],
    Big = binary:copy(<<"w">>, ?MAX_FRAME + 4096),
    [erlang:send({soak_warm, N}, Big) || {N, _} <- New, _ <- lists:seq(1, 8)],
    S#{warmed => maps:merge(Warmed, maps:from_list([{P, After} || {_, P} <- New]))}.

%% The memory rule's own check: SOAK_LEAK=beam makes the witness BEAM keep
%% 64 KiB more every 125 ms; the run must then fail on it.
leak(#{peers := #{?WITNESS := #{peer := P}}} = S) ->
    case os:getenv("SOAK_LEAK") of
        "beam" ->
            io:format("soak: SOAK_LEAK=beam: the witness BEAM leaks 512 KiB/s~n"),
            _ = peer:call(P, erlang, spawn, [?MODULE, leaker, []]),
            S;
        _ -> S
    end.

-spec leaker() -> no_return().
leaker() -> leaker([]).

leaker(Kept) ->
    receive after 125 -> ok end,
    leaker([binary:copy(<<0>>, 65536) | Kept]).

%% VmRSS (shown) and, to tell what grew, RssAnon (the heap) and
%% RssShmem (shared memory touched: snapshot pages, rings) (shown only).
rss_rows(Node, OsPid) ->
    {Rss, Anon, Shmem} = rss(OsPid),
    {NMaps, MapBytes} = shm_maps(OsPid),
    [{{rss, Node}, {OsPid, Rss}}, {{rss_anon, Node}, {OsPid, Anon}},
     {{rss_shmem, Node}, {OsPid, Shmem}}, {{shm_maps, Node}, {OsPid, NMaps}},
     {{shm_mapped, Node}, {OsPid, MapBytes}}].

%% The shared mappings of a process (snapshot segments in /dev/shm, ring
%% segments as memfds): how many, and their size.
shm_maps(OsPid) ->
    case file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/maps") of
        {ok, B} ->
            Ls = [L || L <- binary:split(B, <<"\n">>, [global]),
                       binary:match(L, [<<"/dev/shm/">>, <<"/memfd:">>]) =/= nomatch],
            {length(Ls), lists:sum([map_size_of(L) || L <- Ls])};
        _ -> {0, 0}
    end.

map_size_of(L) ->
    [R | _] = binary:split(L, <<" ">>),
    [A, B] = binary:split(R, <<"-">>),
    binary_to_integer(B, 16) - binary_to_integer(A, 16).

%% On a peer: N samples of erlang:memory/0 (and the allocators' blocks),
%% GapMs apart, each taken once no process has a message queued (or after
%% 500 ms: a process may keep one it never receives) and after a garbage
%% collection of every process. Returns the sample of the least total (its
%% parts are then consistent with it), and every sample's total and
%% `system' (the spread, shown in the table). With SOAK_DIAG, each sample
%% also holds its breakdown (diag/0).
-spec settled_memory(pos_integer(), non_neg_integer()) -> map().
settled_memory(N, GapMs) ->
    Diag = diag_dir() =/= false,
    Samples = [begin
                   I > 1 andalso receive after GapMs -> true end,
                   drain_mailboxes(now_ms() + 500),
                   Pre = Diag andalso erlang:memory(system),
                   [erlang:garbage_collect(P) || P <- processes()],
                   M = erlang:memory()
                       ++ [{{alloc, A}, alloc_blocks(A)} || A <- erlang:system_info(alloc_util_allocators)],
                   case Diag of
                       true ->
                           %% `system' before the collection, right after
                           %% it (in M), then after the allocator reads
                           %% above, and 50 and 200 ms later.
                           Post = [begin receive after T -> ok end, erlang:memory(system) end
                                   || T <- [0, 50, 150]],
                           {M, (diag())#{system_gc => [Pre, proplists:get_value(system, M) | Post]}};
                       false -> {M, none}
                   end
               end || I <- lists:seq(1, N)],
    Totals = [proplists:get_value(total, M) || {M, _} <- Samples],
    Floor = lists:min(Totals),
    {FloorM, _} = hd([X || {M, _} = X <- Samples, proplists:get_value(total, M) =:= Floor]),
    #{floor => FloorM, totals => Totals,
      systems => [proplists:get_value(system, M) || {M, _} <- Samples],
      diag => [D || {_, D} <- Samples, D =/= none]}.

drain_mailboxes(Deadline) ->
    Me = self(),
    Busy = [P || P <- processes(), P =/= Me,
                 {message_queue_len, L} <- [process_info(P, message_queue_len)], L > 0],
    case Busy =/= [] andalso now_ms() < Deadline of
        true -> receive after 10 -> ok end, drain_mailboxes(Deadline);
        false -> ok
    end.

%% What a sample is made of, to tell what moved between two: per
%% allocation type (instrument, with +Muatags true: bytes estimated from
%% its histogram, and counts), the largest processes (memory, queue, refc
%% binaries held) and ETS tables.
diag() ->
    Tags = case catch instrument:allocations(#{histogram_start => 128, histogram_width => 20}) of
               {ok, {Start, _, ByOrigin}} ->
                   [{{Origin, T}, hist_bytes(Start, H), lists:sum(tuple_to_list(H))}
                    || {Origin, Types} <- maps:to_list(ByOrigin), {T, H} <- maps:to_list(Types)];
               Other -> Other
           end,
    Procs = [{P, proplists:get_value(registered_name, I), proplists:get_value(initial_call, I),
              proplists:get_value(memory, I), proplists:get_value(message_queue_len, I),
              lists:sum([Sz || {_, Sz, _} <- proplists:get_value(binary, I)])}
             || P <- processes(),
                I <- [process_info(P, [registered_name, initial_call, memory, message_queue_len, binary])],
                I =/= undefined],
    Ets = [{T, ets:info(T, name), ets:info(T, size), ets:info(T, memory)} || T <- ets:all()],
    #{tags => Tags,
      procs => lists:sublist(lists:reverse(lists:keysort(4, Procs)), 10),
      bin_holders => lists:sublist(lists:reverse(lists:keysort(6, Procs)), 10),
      ets => lists:sublist(lists:reverse(lists:keysort(4, [E || {_, _, _, W} = E <- Ets, is_integer(W)])), 10),
      n_procs => length(Procs), n_ports => length(erlang:ports())}.

%% Bytes in a histogram of block sizes: each block counted at its bucket's
%% middle (the first bucket, under Start bytes, at Start / 2).
hist_bytes(Start, H) ->
    lists:sum([C * case I of 0 -> Start div 2; _ -> (Start bsl (I - 1)) * 3 div 2 end
               || {I, C} <- lists:zip(lists:seq(0, tuple_size(H) - 1), tuple_to_list(H))]).

alloc_blocks(A) ->
    lists:sum([Sz || {instance, _, L} <- erlang:system_info({allocator, A}),
                     K <- [mbcs, sbcs], {blocks, Bs} <- proplists:get_value(K, L, []),
                     {_, Ps} <- Bs, {size, Sz, _, _} <- Ps]).

%% erlang:memory(total) (checked) and its parts, to tell what grew (shown
%% only), from the floor sample; and how far the samples spread.
beam_rows(N, OsPid, #{floor := Mem, totals := Ts, systems := Ss}) ->
    [{{beam, N}, {OsPid, proplists:get_value(total, Mem)}},
     {{beam_spread, N}, {OsPid, lists:max(Ts) - lists:min(Ts)}},
     {{{beam, system_spread}, N}, {OsPid, lists:max(Ss) - lists:min(Ss)}}
     | [{{{beam, K}, N}, {OsPid, proplists:get_value(K, Mem)}}
        || K <- [processes, ets, binary, code, atom, system]]]
        ++ [{{beam_alloc, A, N}, {OsPid, V}} || {{alloc, A}, V} <- Mem].

rss(OsPid) ->
    case file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/status") of
        {ok, St} ->
            {status_kib(St, "VmRSS") * 1024, status_kib(St, "RssAnon") * 1024,
             status_kib(St, "RssShmem") * 1024};
        _ -> {0, 0, 0}
    end.

status_kib(St, Key) ->
    case re:run(St, Key ++ ":\\s+([0-9]+) kB", [{capture, all_but_first, binary}]) of
        {match, [K]} -> binary_to_integer(K);
        nomatch -> 0
    end.

%% What a process owns is compared, not its high-water marks. Each epoch
%% end's value is the least of ?MEM_SAMPLES samples 500 ms apart, the load
%% paused, each on a BEAM after its mailboxes drained and a garbage
%% collection of every process (sample_memory/1, settled_memory/2): the
%% 300 and 600 s runs (SOAK_DIAG) showed the peer BEAMs' `system' 2 to 10 MiB
%% higher (steps of 2.0 MiB) in the first sample after the load stops, in
%% about half of the epochs, already before that collection, and gone
%% within milliseconds once every scheduler ran (reading the allocators'
%% state): memory already released by the VM whose deallocation waits for
%% its scheduler, which went to sleep when the load stopped; no allocation
%% type (instrument) holds it a moment later. Taken alone, one such sample
%% (one sample per epoch end) three in a row made a 300 s run fail at
%% +19%; the least of five did not have it in any epoch of the runs since. Then the
%% warm-up floor is the least of the first two epoch values at or after T1
%% (a minute; a quarter of shorter runs), after the first epoch's (which
%% ran every fault, so every path ran and its code was loaded) and, for a
%% C node, after its receive buffers were warmed (warm_recv_buffers/1);
%% the end floor is the least of the last three. A leak raises every
%% sample; a transient does not. Checked: each BEAM's
%% erlang:memory(total) (which counts allocated blocks, not the carriers
%% the allocators keep) and each C node's RssAnon (its heap). Shared pages
%% (RssShmem) are not growth: a receptionist's snapshot segment is touched
%% page by page up to its configured size, so instead every sample checks
%% that each C node maps no more than it may: a receptionist one segment
%% of receptionist_shm_mb, a pool node at most one ring segment per live
%% peer BEAM (a dead BEAM's segment must be unmapped).
memory_check(#{t1 := T1} = S0) ->
    Curve = lists:zip(lists:seq(1, length(maps:get(mem_curve, S0, []))),
                      lists:reverse(maps:get(mem_curve, S0, []))),
    S = shm_check([C || {_, C} <- Curve], S0),
    Warmed = maps:get(warmed, S, #{}),
    Last = case Curve of [] -> #{}; _ -> element(2, element(2, lists:last(Curve))) end,
    Rows = lists:append(
             [case [V || {I, {T, M}} <- Curve, I >= 2, T >= T1, I > maps:get(Pid, Warmed, 0),
                         {P, V} <- [maps:get(What, M, none)], P =:= Pid] of
                  [V1, V2 | Rest] when length(Rest) >= 3 ->
                      [V3, V4, V5] = lists:nthtail(length(Rest) - 3, Rest),
                      [{What, min(V1, V2), lists:min([V3, V4, V5])} || min(V1, V2) > 0];
                  _ -> []
              end || {What, {Pid, _}} <- maps:to_list(Last), checked(What)]),
    %% The witness's BEAM and its two C nodes at least.
    S1 = case length(Rows) >= 3 of
             true -> S#{mem_rows => Rows};
             false -> fail(S#{mem_rows => Rows}, "memory: too few processes lived from the "
                           "warm-up to the end to compare (~p)", [Rows])
         end,
    lists:foldl(fun({What, V0, V1}, Acc) when V1 > V0 * (1 + ?GROWTH) ->
                        fail(Acc, "memory of ~p grew ~.1f% (floor ~b -> ~b bytes)",
                             [What, 100 * (V1 - V0) / V0, V0, V1]);
                   (_, Acc) -> Acc
                end, S1, Rows).

checked({beam, _}) -> true;
checked({rss_anon, _}) -> true;
checked(_) -> false.

shm_check(Curve, S) ->
    Bound = ?SHM_MB * 1024 * 1024,
    NPeers = 3,
    Bad = lists:usort(
            [{What, V} || {_, M} <- Curve, {{K, N} = What, {_, V}} <- maps:to_list(M),
                          (K =:= shm_maps andalso rcpt(N) andalso V > 1)
                              orelse (K =:= shm_mapped andalso rcpt(N) andalso V > Bound)
                              orelse (K =:= shm_maps andalso not rcpt(N) andalso V > NPeers)]),
    case Bad of
        [] -> S;
        _ -> fail(S, "shared memory mapped beyond its bound: ~p", [Bad])
    end.

rcpt(N) -> lists:suffix("_receptionist", hd(string:split(atom_to_list(N), "@"))).

%% ===================================================================
%% Teardown and leaks
%% ===================================================================

teardown(#{peers := Peers, standalone := #{os_pid := SPid, port := Port}, prefix := Prefix, dir := Dir} = S) ->
    [begin catch peer:call(P, application, stop, [actor_pool], 30000), catch peer:stop(P) end
     || #{peer := P} <- maps:values(Peers)],
    kill(SPid),
    exit(Port, kill),
    Pids = lists:usort(maps:get(pids, S) ++ case get(rawpeer_pids) of undefined -> []; L -> L end),
    S1 = case wait_leak(fun() -> [P || P <- Pids, os_pid_alive(P)] end) of
             [] -> S;
             Alive -> fail(S, "OS processes left: ~p", [Alive])
         end,
    S2 = case wait_leak(fun() -> [N || N <- epmd_names(), lists:prefix(Prefix, N)] end) of
             [] -> S1;
             Names -> fail(S1, "epmd names left: ~p", [Names])
         end,
    S3 = case wait_leak(fun() -> segments(Prefix) end) of
             [] -> S2;
             Segs -> fail(S2, "/dev/shm segments left: ~p", [Segs])
         end,
    _ = file:del_dir_r(Dir),
    S3.

wait_leak(Fun) ->
    try wait_until(fun() -> Fun() =:= [] end, ?WAIT_MS), []
    catch error:_ -> Fun()
    end.

segments(Prefix) ->
    case file:list_dir("/dev/shm") of
        {ok, Names} -> [N || "actor_pool." ++ Rest = N <- Names, lists:prefix(Prefix, Rest)];
        {error, _} -> []
    end.

%% ===================================================================
%% Table
%% ===================================================================

table(S) ->
    Counts = ledger_call(S, counts),
    Mine = maps:get(counts, S, #{}),
    io:format("~n== soak table (seed ~b) ==~n", [maps:get(seed, S)]),
    io:format("~-60ts ~12ts~n", ["operation", "count"]),
    [row(io_lib:format("tell -> ~p", [T]), N) || {{tell, T}, N} <- lists:sort(maps:to_list(Counts))],
    row("tells checked (fault-free windows)", maps:get(tells_checked, Mine, 0)),
    row("tells counted as dropped there", maps:get(tells_dropped_counted, Mine, 0)),
    [row(io_lib:format("ask ~p: ~p", [P, K]), N) || {{ask, P, K}, N} <- lists:sort(maps:to_list(Counts))],
    [row(io_lib:format("asks late (> timeout + margin): ~p", [P]), N)
     || {{late_ask, P}, N} <- lists:sort(maps:to_list(Counts))],
    [row(io_lib:format("register ~p", [R]), N) || {{reg, R}, N} <- lists:sort(maps:to_list(Counts))],
    [row(io_lib:format("deregister ~p", [R]), N) || {{dereg, R}, N} <- lists:sort(maps:to_list(Counts))],
    row("subscribe", maps:get(sub, Counts, 0)),
    row("reports of killed peers (in flight)", maps:get(dropped_report_of_dead_peer, Counts, 0)),
    row("registrations checked at the end", maps:get(regs_checked, Mine, 0)),
    row("subscriptions checked at the end", maps:get(subscriptions_checked, Mine, 0)),
    io:format("-- faults --~n"),
    [row(io_lib:format("~p", [F]), N) || {{fault, F}, N} <- lists:sort(maps:to_list(Mine))],
    row("idle client connections", maps:get(idle_clients, Mine, 0)),
    case maps:get(netns, S) of
        {skip, Why} -> io:format("netns cut not run: ~ts~n", [Why]);
        ok -> ok
    end,
    io:format("-- answers by kind --~n"),
    [row(io_lib:format("~p", [W]), N) || {{ok, W}, N} <- lists:sort(maps:to_list(Mine))],
    [row(io_lib:format("BAD ~p", [W]), N) || {{bad, W}, N} <- lists:sort(maps:to_list(Mine))],
    io:format("-- memory (warm-up floor -> end floor) --~n"),
    [io:format("~-60ts ~12b -> ~12b (~.1f%)~n", [io_lib:format("~p", [W]), V0, V1, 100 * (V1 - V0) / V0])
     || {W, V0, V1} <- lists:sort(maps:get(mem_rows, S, []))],
    curve(S),
    ok.

%% Each sampled value of each process alive at the last sample, per epoch
%% end (KiB; counts as they are): a plateau or a slope.
curve(S) ->
    case lists:reverse(maps:get(mem_curve, S, [])) of
        [] -> ok;
        Curve ->
            {_, Last} = lists:last(Curve),
            io:format("-- memory curve (KiB at ~w s) --~n", [[T || {T, _} <- Curve]]),
            [io:format("~-60ts ~ts~n", [io_lib:format("~p", [W]),
                                        lists:join(" ", [curve_point(W, Pid, M) || {_, M} <- Curve])])
             || {W, {Pid, _}} <- lists:sort(maps:to_list(Last))],
            ok
    end.

curve_point(W, Pid, M) ->
    case maps:get(W, M, none) of
        {Pid, V} when element(1, W) =:= shm_maps -> integer_to_list(V);
        {Pid, V} -> integer_to_list(V div 1024);
        _ -> "-"
    end.

row(Label, N) -> io:format("~-60ts ~12b~n", [Label, N]).

%% ===================================================================
%% Helpers
%% ===================================================================

fail(S, Fmt, Args) ->
    Line = lists:flatten(io_lib:format(Fmt, Args)),
    io:format("soak: FAILURE: ~ts~n", [Line]),
    S#{failures := [Line | maps:get(failures, S)]}.

count(S, K, N) ->
    S#{counts => maps:update_with(K, fun(V) -> V + N end, N, maps:get(counts, S, #{}))}.

now_ms() -> erlang:monotonic_time(millisecond).

kill(OsPid) -> _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)), ok.

%% ap_support's, with a condition that may raise while a node restarts.
wait_until(Fun, TimeoutMs) ->
    ap_support:wait_until(fun() -> (catch Fun()) =:= true end, TimeoutMs).

os_pid_alive(OsPid) -> ap_support:os_pid_alive(OsPid).

epmd_names() -> ap_support:epmd_names().
