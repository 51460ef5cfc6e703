#!/usr/bin/env escript
%% -*- erlang -*-
%%
%% `make demo': starts the actor_pool application (which makes this node
%% distributed and starts its pool C node), then puts two pools to work:
%%
%%   - a json_validate pool validates a few thousand generated JSON documents
%%     (orders with nested items; about one in eight broken on purpose) from
%%     eight concurrent callers, then takes as many again as fire-and-forget
%%     tells, and prints what it found and its stats;
%%   - an echo pool answers asks, gen_server:call and tells;
%%   - a cluster: this node and two peer BEAM nodes on loopback, plus a
%%     standalone pool node (priv/actor_pool_node) whose json_validate pool
%%     registers with the receptionist under "json-validator". The peers
%%     discover it by subscription and send it work by key (asks and
%%     tells); the pool node is killed and the peers' listings shrink, it
%%     runs again and they grow.
%%
%% `--short' uses fewer documents (the test suite runs it so). Exits 1 if
%% any step does not give the expected result; stops everything it started.
-mode(compile).

-define(DOCS, 3000).
-define(CALLERS, 8).

main(Args) ->
    Root = filename:dirname(filename:dirname(filename:absname(escript:script_name()))),
    Ebins = case filelib:wildcard(filename:join([Root, "_build", "default", "lib", "*", "ebin"])) of
                [] -> filelib:wildcard(filename:join([Root, "_build", "test", "lib", "*", "ebin"]));
                Found -> Found
            end,
    ok = code:add_pathsa(Ebins),
    put(demo_docs, case Args of ["--short"] -> 400; _ -> ?DOCS end),
    put(demo_root, Root),
    put(demo_ebins, Ebins),
    %% demo_node: what the peers run, and the demo's own chunking;
    %% ap_support: polling with a deadline and epmd's names (shared with
    %% the tests and the benchmarks, not part of the library).
    Bin = load_source(filename:join([Root, "scripts", "demo_node.erl"])),
    put(demo_node_bin, Bin),
    _ = load_source(filename:join([Root, "support", "ap_support.erl"])),
    try run() of
        ok ->
            io:format("~ndemo: all steps gave the expected result~n"),
            halt(0)
    catch
        Class:Reason:Stack ->
            io:format("~ndemo: FAILED ~p:~p~n~p~n", [Class, Reason, Stack]),
            cleanup(),
            halt(1)
    end.

%% Compiles File in memory and loads it; its object code.
load_source(File) ->
    {ok, Mod, Bin} = compile:file(File, [binary, report]),
    {module, Mod} = code:load_binary(Mod, File, Bin),
    Bin.

run() ->
    {ok, _} = application:ensure_all_started(actor_pool),
    show("this BEAM node", node()),
    show("actor_pool:pool_node()", actor_pool:pool_node()),

    %% ---- JSON validation ------------------------------------------------
    section("a json_validate pool"),
    {ok, Json} = actor_pool:start_pool(demo_json, json_validate, #{workers => 4}),
    show("actor_pool:start_pool(demo_json, json_validate, #{workers => 4})", {ok, Json}),
    rand:seed(exsss, {1, 2, 3}),
    NDocs = get(demo_docs),
    Docs = [document(I) || I <- lists:seq(1, NDocs)],
    Bytes = lists:sum([byte_size(D) || {_, D} <- Docs]),
    Broken = length([x || {broken, _} <- Docs]),
    show("documents generated", {NDocs, {bytes, Bytes}, {broken_on_purpose, Broken}}),

    T0 = erlang:monotonic_time(microsecond),
    Results = parallel_asks(Json, Docs),
    Us = erlang:monotonic_time(microsecond) - T0,
    Valid = [ok || {valid, {ok, ok}} <- Results],
    Invalid = [{D, E} || {{broken, D}, {error, {Offset, _}} = E} <- Results, is_integer(Offset)],
    Wrong = [R || R <- Results, not expected(R)],
    show("asks answered {ok, ok}", length(Valid)),
    show("asks answered {error, {Offset, Reason}}", length(Invalid)),
    show("answers that disagree with the generator", length(Wrong)),
    [] = Wrong,
    show("throughput of the asks (8 callers)",
         {round(NDocs * 1.0e6 / max(1, Us)), docs_per_s}),
    io:format("~nsome broken documents and where the validator stopped:~n"),
    [explain(D, E) || {D, E} <- lists:sublist(Invalid, 4)],

    %% The same documents again, as tells: nothing waits for an answer.
    #{processed := P0} = actor_pool:stats(Json),
    [ok = actor_pool:tell(Json, D) || {_, D} <- Docs],
    Stats = wait_processed(Json, P0 + NDocs, 30000),
    io:format("~n"),
    show("after the tells: actor_pool:stats(demo_json)", summary(Stats)),
    [show("  worker " ++ integer_to_list(Id), W)
     || #{id := Id} = W0 <- maps:get(workers, Stats),
        W <- [maps:with([alive, mailbox, processed, restarts], W0)]],
    expect("errors counted (each broken document twice)", 2 * Broken, maps:get(errors, Stats)),
    expect("documents processed (asks and tells)", 2 * NDocs, maps:get(processed, Stats)),

    %% ---- echo -----------------------------------------------------------
    section("an echo pool"),
    {ok, Echo} = actor_pool:start_pool(demo_echo, echo, #{workers => 2,
                                                          routing => smallest_mailbox}),
    Term = {order, 42, [<<"widget">>, 3.5], #{paid => true}},
    expect("actor_pool:ask(demo_echo, Term)", {ok, Term}, actor_pool:ask(demo_echo, Term)),
    expect("gen_server:call(EchoPid, <<\"hi\">>)", {ok, <<"hi">>}, gen_server:call(Echo, <<"hi">>)),
    [ok = actor_pool:tell(Echo, <<"fire and forget">>) || _ <- lists:seq(1, 10000)],
    EchoStats = wait_processed(Echo, 10002, 30000),
    show("actor_pool:stats(demo_echo)", summary(EchoStats)),

    show("actor_pool:which_pools()", actor_pool:which_pools()),
    expect("actor_pool:stop_pool(demo_json)", ok, actor_pool:stop_pool(demo_json)),
    expect("actor_pool:stop_pool(Echo)", ok, actor_pool:stop_pool(Echo)),
    %% Gone: the pool node's manager says so. (Not an ask to the freed name:
    %% by distribution the pool node would log the message to a name it no
    %% longer has as a warning, by ring it would not.)
    expect("actor_pool:which_pools() after the stops", [], actor_pool:which_pools()),
    expect("actor_pool:stop_pool(demo_json) again", {error, noproc}, actor_pool:stop_pool(demo_json)),

    cluster(Docs),

    ok = application:stop(actor_pool),
    show("application:stop(actor_pool)", ok),
    _ = net_kernel:stop(),
    ok.

%% ===================================================================
%% The cluster
%% ===================================================================

cluster(Docs) ->
    section("a cluster: this node, two peers, a standalone pool node"),
    Key = actor_receptionist:service_key(<<"json-validator">>),
    Tag = os:getpid(),
    Peers = [start_peer(list_to_atom("demo_" ++ L ++ "_" ++ Tag)) || L <- ["b", "c"]],
    put(demo_peers, Peers),
    [B, C] = [N || {_, N} <- Peers],
    Members = lists:sort([node(), B, C]),
    [true = erpc:call(X, net_kernel, connect_node, [Y]) || X <- [B, C], Y <- Members, X =/= Y],
    [wait(fun() ->
                  case erpc:call(N, actor_receptionist, status, []) of
                      #{complete := true, members := M} -> M =:= Members -- [N];
                      _ -> false
                  end
          end, 20000, {members, N}) || N <- Members],
    show("members, as node " ++ atom_to_list(B) ++ " sees them",
         maps:get(members, erpc:call(B, actor_receptionist, status, []))),
    Watchers = [erpc:call(N, demo_node, watch, [Key, self(), N]) || N <- [B, C]],
    put(demo_watchers, lists:zip([B, C], Watchers)),
    await_listings([B, C], 0),

    %% The standalone pool node, a hidden node that registers its pool.
    PoolNode = start_pool_node(Tag),
    await_listings([B, C], 1),
    Pool = {json, PoolNode},

    %% Work by key from the peers: asks from one, tells from the other.
    {Valid, Invalid, Other, Us} = erpc:call(B, demo_node, asks, [Key, Docs, ?CALLERS], 60000),
    show(atom_to_list(B) ++ ": asks by key (8 callers), valid / invalid", {Valid, Invalid}),
    show(atom_to_list(B) ++ ": throughput", {round(length(Docs) * 1.0e6 / max(1, Us)), docs_per_s}),
    expect("answers that disagree with the generator", [], Other),
    #{processed := P0} = actor_pool:stats(Pool),
    ok = erpc:call(C, demo_node, tells, [Key, Docs], 60000),
    Stats = wait_processed(Pool, P0 + length(Docs), 30000),
    show(atom_to_list(C) ++ ": tells by key; then actor_pool:stats(" ++ atom_to_list(json) ++ ")",
         summary(Stats)),

    %% The pool node dies: every subscriber's listing shrinks.
    section("the pool node is killed"),
    kill_pool_node(),
    await_listings([B, C], 0),
    expect(atom_to_list(B) ++ ": actor_pool:ask(Key, Doc)", {error, no_pool},
           erpc:call(B, actor_pool, ask, [Key, <<"{}">>])),

    section("the pool node runs again"),
    PoolNode = start_pool_node(Tag),
    await_listings([B, C], 1),
    expect(atom_to_list(C) ++ ": actor_pool:ask(Key, <<\"{}\">>)", {ok, ok},
           erpc:call(C, actor_pool, ask, [Key, <<"{}">>])),
    stop_cluster(),
    show("the cluster stopped (peers, pool node)", ok).

start_peer(Name) ->
    %% Quiet peers: their C nodes' start-up notices would interleave. A
    %% peer stops by init:stop (its applications stop, global is told), not
    %% by halt: see stop_peers/1.
    {ok, Peer, Node} = peer:start(#{name => Name, shutdown => 20000,
                                    args => ["-kernel", "logger_level", "warning",
                                             "-pa" | get(demo_ebins)]}),
    ok = erpc:call(Node, application, load, [actor_pool]),
    ok = erpc:call(Node, application, set_env, [actor_pool, pool_node, false]),
    ok = erpc:call(Node, application, set_env, [actor_pool, receptionist_shm_mb, 32]),
    {ok, _} = erpc:call(Node, application, ensure_all_started, [actor_pool]),
    {module, demo_node} = erpc:call(Node, code, load_binary,
                                    [demo_node, "demo_node.erl", get(demo_node_bin)]),
    show("peer started", Node),
    {Peer, Node}.

%% priv/actor_pool_node --name demo_pool_<pid>@host --connect <this node>
%%     --pool json:json_validate:2:key=json-validator
start_pool_node(Tag) ->
    Dir = filename:join(os:getenv("TMPDIR", "/tmp"), "actor_pool_demo_" ++ Tag),
    ok = filelib:ensure_dir(filename:join(Dir, "x")),
    Cookie = filename:join(Dir, "cookie"),
    ok = file:write_file(Cookie, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(Cookie, 8#600),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Node = list_to_atom("demo_pool_" ++ Tag ++ "@" ++ Host),
    Exe = filename:join(code:priv_dir(actor_pool), "actor_pool_node"),
    Args = ["--name", atom_to_list(Node), "--cookie-file", Cookie, "--connect", atom_to_list(node()),
            "--pool", "json:json_validate:2:key=json-validator"],
    Port = open_port({spawn_executable, Exe}, [{args, Args}, exit_status, binary, stderr_to_stdout]),
    {os_pid, OsPid} = erlang:port_info(Port, os_pid),
    put(demo_pool_node, {Port, OsPid, Node, Dir}),
    show("actor_pool_node " ++ lists:flatten(lists:join(" ", Args -- ["--cookie-file", Cookie])),
         {os_pid, OsPid}),
    Node.

kill_pool_node() ->
    case erase(demo_pool_node) of
        {Port, OsPid, Node, _Dir} ->
            _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
            show("kill -9", OsPid),
            receive {Port, {exit_status, _}} -> ok after 5000 -> ok end,
            catch port_close(Port),
            wait(fun() -> not lists:member(Node, nodes(hidden)) end, 10000, {gone, Node});
        undefined ->
            ok
    end.

%% Every watcher on Nodes reports a listing with N pools.
await_listings(Nodes, N) ->
    [receive
         {demo_listing, Node, N, PoolNodes} ->
             show("  " ++ atom_to_list(Node) ++ ": listing for \"json-validator\"",
                  {pools, N, PoolNodes})
     after 20000 ->
             error({no_listing, Node, N})
     end || Node <- Nodes],
    ok.

stop_cluster() ->
    kill_pool_node(),
    Unheld = stop_peers(get_list(demo_peers)),
    erase(demo_peers),
    Root = "demo_",
    wait(fun() -> [A || A <- ap_support:epmd_names(), lists:prefix(Root, A),
                        lists:suffix(os:getpid(), hd(string:split(A, "_receptionist")))] =:= []
         end, 20000, epmd_names),
    case Unheld of
        [] -> ok;
        _ -> error({peers_not_stopped_together, Unheld})
    end.

%% Stops the peers together: none leaves before all are stopping. Stopped
%% one by one, each leaving peer would make global (OTP 25+,
%% prevent_overlapping_partitions) on the nodes that stay tell each other
%% that they lost it; whichever hears so before its own connection to the
%% peer is down drops that connection and logs a warning ("requested
%% disconnect ... to prevent overlapping partitions"). A node whose
%% init:stop has begun neither tells nor heeds that (init prepares global
%% for the shutdown), so once every peer is stopping only this node tells,
%% and no node still listening has lost anything. The peers stop by
%% peer:stop (init:stop, then it waits for the node to go), and each one's
%% shutdown waits at demo_node:shutdown_gate/1 until all are stopping.
%% Returns the peers that did not say they were stopping (they stop all the
%% same).
stop_peers(Peers) ->
    Self = self(),
    Held = [N || {_, N} <- Peers, (catch erpc:call(N, demo_node, hold_shutdown, [Self])) =:= ok],
    Stoppers = [spawn_monitor(fun() -> peer:stop(P) end) || {P, _} <- Peers],
    Gates = [receive
                 {demo_stopping, N, Gate} -> {N, Gate}
             after 20000 -> {N, none}
             end || N <- Held],
    _ = [Gate ! demo_go || {_, Gate} <- Gates, is_pid(Gate)],
    _ = [receive {'DOWN', Ref, process, Pid, _} -> ok end || {Pid, Ref} <- Stoppers],
    [N || {_, N} <- Peers, not lists:member(N, Held)] ++ [N || {N, none} <- Gates].

get_list(Key) ->
    case get(Key) of
        undefined -> [];
        L -> L
    end.

%% Polls Fun every 20 ms until it is true; fails the demo naming What
%% after Timeout ms.
wait(Fun, Timeout, What) ->
    case ap_support:poll(Fun, fun(B) -> B end, Timeout, 20) of
        {ok, true} -> ok;
        {timeout, false} -> error({timeout, What})
    end.

%% ===================================================================
%% Work
%% ===================================================================

%% Every document goes to the pool as an ask, from ?CALLERS processes at once.
parallel_asks(Pool, Docs) ->
    Self = self(),
    Chunks = demo_node:split(lists:zip(lists:seq(1, length(Docs)), Docs), ?CALLERS),
    Pids = [spawn_link(fun() ->
                               Self ! {done, self(),
                                       [{I, {Kind, D}, actor_pool:ask(Pool, D, 10000)}
                                        || {I, {Kind, D}} <- Chunk]}
                       end) || Chunk <- Chunks],
    Answers = lists:append([receive {done, Pid, R} -> R end || Pid <- Pids]),
    [{kind(Kind, D), Reply} || {_, {Kind, D}, Reply} <- lists:keysort(1, Answers)].

kind(valid, _D) -> valid;
kind(broken, D) -> {broken, D}.

expected({valid, {ok, ok}}) -> true;
expected({{broken, _}, {error, {Offset, _}}}) when is_integer(Offset) -> true;
expected(_) -> false.

%% Pool's stats once it has processed N messages (polled every 10 ms).
wait_processed(Pool, N, Timeout) ->
    case ap_support:poll(fun() -> actor_pool:stats(Pool) end,
                         fun(#{processed := P}) -> P >= N; (_) -> false end, Timeout, 10) of
        {ok, Stats} -> Stats;
        {timeout, Stats} -> error({not_processed_in_time, N, Stats})
    end.

summary(Stats) ->
    maps:with([size, routing, processed, errors, crashes, restarts, overloaded,
               dropped_tells, throughput_10s], Stats).

explain(Doc, {error, {Offset, Reason}}) ->
    From = max(0, Offset - 24),
    Around = binary:part(Doc, From, min(byte_size(Doc) - From, 40)),
    io:format("  ~-22s at byte ~5b of ~5b: ...~ts...~n",
              [io_lib:format("~p", [Reason]), Offset, byte_size(Doc),
               printable(Around)]).

printable(Bin) ->
    [case C >= 32 andalso C < 127 of true -> C; false -> $? end || <<C>> <= Bin].

%% ===================================================================
%% Documents: an order with nested items; one in eight broken
%% ===================================================================

document(I) ->
    Valid = order(I),
    case I rem 8 of
        0 -> {broken, break(I div 8 rem 5, Valid)};
        _ -> {valid, Valid}
    end.

order(I) ->
    Items = [[{<<"sku">>, str(<<"SKU-", (integer_to_binary(rand:uniform(99999)))/binary>>)},
              {<<"qty">>, integer_to_binary(rand:uniform(20))},
              {<<"price">>, float_to_binary(rand:uniform() * 500, [{decimals, 2}])},
              {<<"tags">>, array([str(T) || T <- lists:sublist([<<"new">>, <<"sale">>, <<"eco">>],
                                                                rand:uniform(3))])}]
             || _ <- lists:seq(1, rand:uniform(12))],
    iolist_to_binary(
      object([{<<"id">>, integer_to_binary(I)},
              {<<"customer">>, object([{<<"name">>, str(<<"Zo\\u00eb \\\"Q\\\" Doe">>)},
                                       {<<"email">>, str(<<"zoe@example.com">>)}])},
              {<<"paid">>, <<"true">>},
              {<<"coupon">>, <<"null">>},
              {<<"items">>, array([object(It) || It <- Items])},
              {<<"total">>, <<"1.25e3">>}])).

object(Pairs) -> [${, lists:join($,, [[str(K), $:, V] || {K, V} <- Pairs]), $}].
array(Values) -> [$[, lists:join($,, Values), $]].
str(S) -> [$", S, $"].

%% Ways to break a document; each leaves it invalid whatever the content.
break(0, Doc) -> binary:part(Doc, 0, rand:uniform(byte_size(Doc)) - 1);   % truncated
break(1, Doc) -> binary:replace(Doc, <<"]">>, <<",]">>);                    % trailing comma
break(2, Doc) -> binary:replace(Doc, <<"true">>, <<"tru">>);                % bad literal
break(3, Doc) -> binary:replace(Doc, <<"\"paid\"">>, <<"paid">>);           % unquoted key
break(4, Doc) -> <<Doc/binary, " {}">>.                                     % trailing data

%% ===================================================================
%% Output
%% ===================================================================

cleanup() ->
    catch stop_cluster(),
    _ = [catch actor_pool:stop_pool(P) || {_, P} <- catch actor_pool:which_pools()],
    _ = application:stop(actor_pool),
    _ = net_kernel:stop(),
    ok.

section(Title) ->
    io:format("~n== ~ts~n", [Title]).

show(What, Value) ->
    io:format("~ts ~0tp~n", [string:pad(What, 58), Value]).

expect(What, Expected, Value) ->
    show(What, Value),
    case Value of
        Expected -> ok;
        _ -> error({unexpected, What, Value, expected, Expected})
    end.
