%% The metrics endpoint (metrics_port) against clients that do not behave:
%% huge request bodies sent slowly, hundreds of idle connections, overlong
%% lines, too many headers, bodies announced and never sent. The cases run
%% the application with the endpoint on loopback and attack it from this
%% BEAM over real TCP; they check what the BEAM holds (erlang:memory/1, which
%% counts the attacking clients too; the endpoint's accepted sockets among
%% erlang:ports/0) and what the clients see (the answer, and the connection
%% closed). One case runs the endpoint in a peer BEAM under `ulimit -n 256'
%% (stopped with peer:stop/1). The limits checked are the ones
%% docs/operations.md ("Metrics") states.
-module(actor_pool_metrics_abuse_tests).

-import(ap_support, [wait_until/2]).

-include_lib("eunit/include/eunit.hrl").

-export([big_bodies_are_not_buffered/1, idle_connections_are_capped_and_closed/1,
         long_lines_are_refused_unbuffered/1, too_many_headers_are_refused/1,
         announced_bodies_are_refused_unread/1, keep_alive_serves_a_scraper/1,
         a_flood_leaves_a_small_fd_limit_room/1]).

%% The documented limits: connections at once, and the deadline for a
%% request's line and headers (also the idle keep-alive).
-define(CAP, 10).
-define(REQUEST_MS, 5000).
%% What the BEAM may grow by while it is attacked ("a few MB").
-define(MEMORY_SLACK, 8 * 1024 * 1024).
%% Generous deadline for "closed at once" (the server needs milliseconds).
-define(PROMPT_MS, 5000).

abuse_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{timeout, 120, {atom_to_list(T), fun() -> ?MODULE:T(Ctx) end}}
              || T <- [big_bodies_are_not_buffered,
                       idle_connections_are_capped_and_closed,
                       long_lines_are_refused_unbuffered,
                       too_many_headers_are_refused,
                       announced_bodies_are_refused_unread,
                       keep_alive_serves_a_scraper,
                       a_flood_leaves_a_small_fd_limit_room]]
     end}.

setup() ->
    WasAlive = is_alive(),
    ok = actor_dist:ensure_distributed(),
    application:load(actor_pool),
    ok = application:set_env(actor_pool, metrics_port, 0),
    {ok, _} = application:ensure_all_started(actor_pool),
    {ok, Port} = actor_pool_metrics:port(),
    #{was_alive => WasAlive, port => Port}.

cleanup(#{was_alive := WasAlive}) ->
    ok = ap_test_util:stop_app(WasAlive),
    application:unset_env(actor_pool, metrics_port).

%% ===================================================================
%% Cases
%% ===================================================================

%% Four clients announce a 90 MB POST body and send 32 MB of it as fast as
%% the server takes it, then trickle the rest: the server answers after the
%% headers and closes, so the BEAM does not grow and each client sees its
%% connection closed at once.
big_bodies_are_not_buffered(#{port := Port}) ->
    Chunk = binary:copy(<<"b">>, 1 bsl 20),
    Head = ["POST /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: text/plain\r\n"
            "content-length: ", integer_to_list(90 bsl 20), "\r\n\r\n"],
    {Results, Growth} =
        with_memory_peak(fun() -> in_parallel(4, fun() -> flood(Port, Head, Chunk, 32) end) end),
    ?assert(Growth < ?MEMORY_SLACK, {grew_by, Growth}),
    [?assertMatch({closed, _}, R) || R <- Results],
    wait_until(fun() -> server_sockets(Port) =:= [] end, ?PROMPT_MS).

%% 300 idle connections: the BEAM holds at most the cap of them, the rest
%% are answered 503 and closed at once; the held ones are closed after the
%% keep-alive deadline, and a scrape that was refused while they were held
%% gets through then.
idle_connections_are_capped_and_closed(#{port := Port}) ->
    {Socks, Peak} =
        with_peak(fun() -> length(server_sockets(Port)) end,
                  fun() ->
                          Ss = [S || _ <- lists:seq(1, 300), {ok, S} <- [connect(Port)]],
                          ?assertEqual(300, length(Ss)),
                          %% Past the cap: answered 503 and closed at once.
                          ?assertMatch({503, _, _}, response(lists:last(Ss), 'GET')),
                          wait_until(fun() -> length([S || S <- Ss, closed(S)]) >= 300 - ?CAP end,
                                     ?PROMPT_MS),
                          ?assertNot(scrapes(Port)),
                          %% The held ones are closed after the keep-alive,
                          %% and a scrape gets through.
                          wait_until(fun() -> scrapes(Port) end, ?REQUEST_MS + ?PROMPT_MS),
                          wait_until(fun() -> lists:all(fun closed/1, Ss) end, ?PROMPT_MS),
                          Ss
                  end),
    %% The acceptor holds the one it just accepted while it refuses it.
    ?assert(Peak =< ?CAP + 1, {peak, Peak}),
    [gen_tcp:close(S) || S <- Socks],
    wait_until(fun() -> server_sockets(Port) =:= [] end, ?PROMPT_MS).

%% A request line, or a header line, of 32 MB: refused once it passes the
%% line limit; the BEAM does not buffer it and the connection is closed.
long_lines_are_refused_unbuffered(#{port := Port}) ->
    Chunk = binary:copy(<<"a">>, 64 * 1024),
    {Results, Growth} =
        with_memory_peak(
          fun() ->
                  [flood(Port, <<"GET /">>, Chunk, 512),
                   flood(Port, <<"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\nx-long: ">>,
                         Chunk, 512)]
          end),
    ?assert(Growth < ?MEMORY_SLACK, {grew_by, Growth}),
    [?assertMatch({closed, _}, R) || R <- Results].

%% More headers than the limit (each small), or headers of more bytes in
%% all than the limit: 431, and the connection closed.
too_many_headers_are_refused(#{port := Port}) ->
    Many = [["x-h", integer_to_list(I), ": 1\r\n"] || I <- lists:seq(1, 200)],
    Big = [["x-b", integer_to_list(I), ": ", binary:copy(<<"v">>, 1000), "\r\n"]
           || I <- lists:seq(1, 12)],
    [begin
         {ok, S} = connect(Port),
         ok = gen_tcp:send(S, ["GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\n", Hs, "\r\n"]),
         ?assertMatch({431, _, _}, response(S, 'GET')),
         wait_until(fun() -> closed(S) end, ?PROMPT_MS),
         gen_tcp:close(S)
     end || Hs <- [Many, Big]].

%% A request that announces a body is answered at once (405 for a method
%% other than GET and HEAD, else 413), without waiting for the body, and
%% the connection is closed.
announced_bodies_are_refused_unread(#{port := Port}) ->
    [begin
         {ok, S} = connect(Port),
         ok = gen_tcp:send(S, [Method, " /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\n", Hdr, "\r\n"]),
         ?assertMatch({Code, _, _}, response(S, 'GET')),
         wait_until(fun() -> closed(S) end, ?PROMPT_MS),
         gen_tcp:close(S)
     end || {Method, Hdr, Code} <- [{"GET", "content-length: 1000000\r\n", 413},
                                    {"GET", "transfer-encoding: chunked\r\n", 413},
                                    {"POST", "content-length: 1000000\r\n", 405},
                                    {"PUT", "content-length: 10\r\n", 405}]].

%% One HTTP/1.1 connection serves GET, HEAD, a query, a 404 in turn
%% (keep-alive, as Prometheus uses it); idle, it is closed after the
%% keep-alive deadline.
keep_alive_serves_a_scraper(#{port := Port}) ->
    {ok, S} = connect(Port),
    {200, H1, B1} = request(S, 'GET', "/metrics"),
    ?assertEqual(<<"text/plain; version=0.0.4; charset=utf-8">>,
                 proplists:get_value(<<"content-type">>, H1)),
    ?assertMatch({match, _}, re:run(B1, "^# TYPE actor_pool_cnode_up gauge$", [multiline])),
    {200, H2, <<>>} = request(S, 'HEAD', "/metrics"),
    ?assert(binary_to_integer(proplists:get_value(<<"content-length">>, H2)) > 0),
    ?assertMatch({200, _, <<"# HELP", _/binary>>}, request(S, 'GET', "/metrics?from=test")),
    ?assertMatch({404, _, _}, request(S, 'GET', "/")),
    ?assertMatch({200, _, _}, request(S, 'GET', "/metrics/")),
    %% One empty line before a request is ignored (RFC 9112, 2.2).
    ok = gen_tcp:send(S, "\r\nGET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"),
    ?assertMatch({200, _, _}, response(S, 'GET')),
    ?assertNot(closed(S)),
    wait_until(fun() -> closed(S) end, ?REQUEST_MS + ?PROMPT_MS),
    gen_tcp:close(S).

%% The audit's reproducer: a BEAM under `ulimit -n 256' serving metrics,
%% 300 idle connections to its endpoint; its descriptors stay as they were
%% but for the cap, and a node that connects to it then gets pong.
a_flood_leaves_a_small_fd_limit_room(_) ->
    Erl = os:find_executable("erl"),
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE]]),
    {ok, Peer, PeerNode} =
        peer:start(#{name => peer:random_name(ap_metrics_fd), connection => standard_io,
                     exec => {"/bin/sh", ["-c", "ulimit -n 256 && exec \"$0\" \"$@\"", Erl]},
                     args => ["-hidden", "-setcookie", atom_to_list(erlang:get_cookie()),
                              "-pa" | Paths]}),
    Call = fun(M, F, A) -> peer:call(Peer, M, F, A, 30000) end,
    try
        ?assertEqual("256", string:trim(Call(os, cmd, ["ulimit -n"]))),
        ok = Call(application, load, [actor_pool]),
        [ok = Call(application, set_env, [actor_pool, K, V])
         || {K, V} <- [{pool_node, false}, {receptionist, false}, {metrics_port, 0}]],
        {ok, _} = Call(application, ensure_all_started, [actor_pool]),
        {ok, Port} = Call(actor_pool_metrics, port, []),
        OsPid = Call(os, getpid, []),
        Fds = fun() -> {ok, L} = file:list_dir("/proc/" ++ OsPid ++ "/fd"), length(L) end,
        Before = Fds(),
        Socks = [S || _ <- lists:seq(1, 300), {ok, S} <- [connect(Port)]],
        try
            %% A node that connects now finds a descriptor free.
            ?assertNot(lists:member(PeerNode, nodes(hidden))),
            ?assertEqual(pong, net_adm:ping(PeerNode)),
            %% The endpoint holds its cap of them at most (one more while
            %% the acceptor refuses one); the new connection holds one.
            ?assert(Fds() =< Before + ?CAP + 2, {fds, Before, Fds()}),
            %% The endpoint needs no other application (inets no more).
            ?assertNot(lists:keymember(inets, 1, Call(application, which_applications, [])))
        after
            [gen_tcp:close(S) || S <- Socks]
        end
    after
        catch erlang:disconnect_node(PeerNode),
        catch peer:call(Peer, application, stop, [actor_pool], 30000),
        peer:stop(Peer)
    end.

%% ===================================================================
%% Helpers
%% ===================================================================

connect(Port) ->
    gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, false}], ?PROMPT_MS).

%% The endpoint's accepted sockets in this BEAM (the clients' sockets are
%% here too: theirs have the endpoint's port as the peer's, not their own).
server_sockets(Port) ->
    [P || P <- erlang:ports(),
          erlang:port_info(P, name) =:= {name, "tcp_inet"},
          {ok, {_, Local}} <- [inet:sockname(P)],
          Local =:= Port,
          {ok, _} <- [inet:peername(P)]].

%% Whether the server closed S (what it sent before is read and dropped).
closed(S) ->
    case gen_tcp:recv(S, 0, 0) of
        {ok, _} -> closed(S);
        {error, timeout} -> false;
        {error, _} -> true
    end.

%% Sends Prefix, then up to N Chunks as fast as the server takes them, then
%% 1 KB every 100 ms, until the server closes the connection
%% ({closed, Ms} after the prefix) or ?PROMPT_MS passed ({open, BytesSent}).
flood(Port, Prefix, Chunk, N) ->
    {ok, S} = connect(Port),
    T0 = erlang:monotonic_time(millisecond),
    ok = gen_tcp:send(S, Prefix),
    R = flood(S, Chunk, N, T0 + ?PROMPT_MS, iolist_size(Prefix)),
    gen_tcp:close(S),
    case R of
        closed -> {closed, erlang:monotonic_time(millisecond) - T0};
        {open, Sent} -> {open, Sent}
    end.

flood(S, Chunk, N, Deadline, Sent) ->
    case closed(S) of
        true ->
            closed;
        false ->
            case erlang:monotonic_time(millisecond) > Deadline of
                true ->
                    {open, Sent};
                false ->
                    %% The trickle's pace is the client's, not a wait
                    %% for the server.
                    {Data, Next} =
                        case N > 0 of
                            true -> {Chunk, N - 1};
                            false -> receive after 100 -> {binary:part(Chunk, 0, 1024), 0} end
                        end,
                    case gen_tcp:send(S, Data) of
                        ok -> flood(S, Chunk, Next, Deadline, Sent + byte_size(Data));
                        {error, _} -> closed
                    end
            end
    end.

in_parallel(N, Fun) ->
    Self = self(),
    Pids = [spawn_link(fun() -> Self ! {self(), Fun()} end) || _ <- lists:seq(1, N)],
    [receive {P, R} -> R end || P <- Pids].

%% Runs Fun while sampling erlang:memory(total): {Result, Peak - Before}.
with_memory_peak(Fun) ->
    garbage_collect(),
    Before = erlang:memory(total),
    {R, Peak} = with_peak(fun() -> erlang:memory(total) end, Fun),
    {R, Peak - Before}.

%% Runs Fun while a process samples Probe(): {Result, the largest sample}.
with_peak(Probe, Fun) ->
    Self = self(),
    W = spawn_link(fun() -> peak(Self, Probe, Probe()) end),
    try Fun() of
        R ->
            W ! {stop, Self},
            receive {W, Peak} -> {R, Peak} end
    after
        unlink(W),
        exit(W, kill)
    end.

peak(Parent, Probe, Max) ->
    receive
        {stop, Parent} -> Parent ! {self(), max(Max, Probe())}
    after 1 ->
            peak(Parent, Probe, max(Max, Probe()))
    end.

%% Whether GET /metrics on a connection of its own gets a 200.
scrapes(Port) ->
    {ok, S} = connect(Port),
    try request(S, 'GET', "/metrics") of
        {200, _, _} -> true;
        _ -> false
    catch
        error:{badmatch, _} -> false
    after
        gen_tcp:close(S)
    end.

request(S, Method, Path) ->
    ok = gen_tcp:send(S, [atom_to_list(Method), $\s, Path,
                          " HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"]),
    response(S, Method).

%% {Code, Headers (names lowercase), Body} of the next answer on S.
response(S, Method) ->
    ok = inet:setopts(S, [{packet, http_bin}]),
    {ok, {http_response, _, Code, _}} = gen_tcp:recv(S, 0, ?PROMPT_MS),
    Headers = response_headers(S),
    Len = binary_to_integer(proplists:get_value(<<"content-length">>, Headers, <<"0">>)),
    ok = inet:setopts(S, [{packet, raw}]),
    Body = case Method of
               'HEAD' -> <<>>;
               _ when Len =:= 0 -> <<>>;
               _ -> {ok, B} = gen_tcp:recv(S, Len, ?PROMPT_MS), B
           end,
    {Code, Headers, Body}.

response_headers(S) ->
    case gen_tcp:recv(S, 0, ?PROMPT_MS) of
        {ok, {http_header, _, _, Name, Value}} ->
            [{string:lowercase(Name), Value} | response_headers(S)];
        {ok, http_eoh} ->
            []
    end.
