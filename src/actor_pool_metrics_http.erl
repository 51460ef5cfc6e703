%% @private The metrics endpoint's HTTP server: `GET' and `HEAD' of
%% `/metrics', over gen_tcp, with small fixed limits (docs/operations.md,
%% "Metrics").
%%
%% It serves one resource to a scraper, so it reads only what a scraper
%% sends: a request line and a few headers. Nothing else is read:
%%
%% <ul>
%% <li>at most ?MAX_CONNECTIONS connections at once; a connection past the
%%     cap gets a 503 and is closed as soon as it is accepted (the BEAM holds
%%     no more than the cap of sockets however many clients connect);</li>
%% <li>a request line or header line longer than ?MAX_LINE bytes, more than
%%     ?MAX_HEADERS headers, or more than ?MAX_HEADER_BYTES of them, is
%%     refused (414 or 431) and the connection closed: the socket's own
%%     packet parser stops at the limit, so nothing longer is buffered;</li>
%% <li>a method other than GET or HEAD is answered 405, a request that
%%     announces a body (Content-Length other than 0, or Transfer-Encoding)
%%     413, and the connection is closed with the body unread;</li>
%% <li>a request's line and headers must arrive within ?REQUEST_MS of the
%%     connection being accepted or of the previous answer: this deadline is
%%     both the slow-client limit and the idle keep-alive;</li>
%% <li>an answer not taken within ?SEND_MS closes the connection.</li>
%% </ul>
%%
%% One gen_server owns the listening socket and counts the connections; an
%% acceptor process accepts, asks it whether the connection is under the
%% cap, and then serves that connection itself while a new acceptor takes
%% its place. Acceptor and connections are linked to the server, which
%% traps exits and kills them when it stops.
-module(actor_pool_metrics_http).
-behaviour(gen_server).

-export([start_link/2, port/0]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2, terminate/2]).

-define(MAX_CONNECTIONS, 10).
-define(MAX_LINE, 4096).
-define(MAX_HEADERS, 32).
-define(MAX_HEADER_BYTES, 8192).
-define(REQUEST_MS, 5000).
-define(SEND_MS, 5000).
%% Connections the kernel may hold before accept: they cost no descriptor
%% of the BEAM, and the acceptor takes them (or refuses them) at once.
-define(BACKLOG, 128).
%% accept failed for want of a descriptor or memory: retry after this.
-define(ACCEPT_RETRY_MS, 100).

-record(state, {listen :: gen_tcp:socket(),
                acceptor :: pid(),
                conns = #{} :: #{pid() => true}}).

%% @doc Listens on Ip:Port (0: a port the OS chooses) and serves.
-spec start_link(inet:ip_address(), inet:port_number()) ->
          {ok, pid()} | {error, term()}.
start_link(Ip, Port) ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, {Ip, Port}, []).

%% @doc The port the server listens on.
-spec port() -> {ok, inet:port_number()} | {error, not_started}.
port() ->
    try gen_server:call(?MODULE, port, 5000)
    catch exit:_ -> {error, not_started}
    end.

%% ===================================================================
%% The server
%% ===================================================================

-spec init({inet:ip_address(), inet:port_number()}) -> {ok, #state{}} | {stop, term()}.
init({Ip, Port}) ->
    process_flag(trap_exit, true),
    Family = case tuple_size(Ip) of 8 -> [inet6]; _ -> [] end,
    %% Accepted sockets inherit these options: the packet parser enforces
    %% the line limit, the send timeout the answer deadline.
    Opts = Family ++ [binary, {ip, Ip}, {active, false}, {reuseaddr, true},
                      {backlog, ?BACKLOG}, {packet, http_bin}, {packet_size, ?MAX_LINE},
                      {nodelay, true}, {send_timeout, ?SEND_MS},
                      {send_timeout_close, true}],
    case gen_tcp:listen(Port, Opts) of
        {ok, L} -> {ok, #state{listen = L, acceptor = spawn_acceptor(L)}};
        {error, Reason} -> {stop, Reason}
    end.

-spec handle_call(term(), gen_server:from(), #state{}) ->
          {reply, term(), #state{}}.
handle_call({accepted, A}, _From, #state{acceptor = A, conns = Conns} = S)
  when map_size(Conns) < ?MAX_CONNECTIONS ->
    %% A serves the connection it accepted; a new acceptor takes its place.
    {reply, serve, S#state{acceptor = spawn_acceptor(S#state.listen),
                           conns = Conns#{A => true}}};
handle_call({accepted, _}, _From, S) ->
    {reply, refuse, S};
handle_call(port, _From, #state{listen = L} = S) ->
    case inet:port(L) of
        {ok, Port} -> {reply, {ok, Port}, S};
        {error, _} -> {reply, {error, not_started}, S}
    end;
handle_call(_, _From, S) ->
    {reply, {error, unknown_call}, S}.

-spec handle_cast(term(), #state{}) -> {noreply, #state{}}.
handle_cast(_, S) ->
    {noreply, S}.

-spec handle_info(term(), #state{}) -> {noreply, #state{}} | {stop, term(), #state{}}.
handle_info({'EXIT', A, Reason}, #state{acceptor = A} = S) ->
    {stop, {acceptor_exit, Reason}, S};
handle_info({'EXIT', Pid, _}, #state{conns = Conns} = S) ->
    %% A connection ended (a crash was logged by proc_lib).
    {noreply, S#state{conns = maps:remove(Pid, Conns)}};
handle_info(_, S) ->
    {noreply, S}.

-spec terminate(term(), #state{}) -> ok.
terminate(_Reason, #state{listen = L, acceptor = A, conns = Conns}) ->
    _ = gen_tcp:close(L),
    [exit(P, kill) || P <- [A | maps:keys(Conns)]],
    ok.

spawn_acceptor(L) ->
    Server = self(),
    proc_lib:spawn_link(fun() -> accept(Server, L) end).

%% ===================================================================
%% The acceptor, then the connection
%% ===================================================================

accept(Server, L) ->
    case gen_tcp:accept(L) of
        {ok, S} ->
            case gen_server:call(Server, {accepted, self()}, infinity) of
                serve ->
                    request(S);
                refuse ->
                    %% A fresh socket's send buffer is empty: the answer
                    %% does not block.
                    ok = refuse(S, 503),
                    accept(Server, L)
            end;
        {error, closed} ->
            exit(normal);
        {error, _} ->
            %% emfile, enfile, enomem: retrying at once would spin.
            receive after ?ACCEPT_RETRY_MS -> ok end,
            accept(Server, L)
    end.

-record(req, {method :: atom() | binary(),
              target :: term(),
              close :: boolean(),
              body = false :: boolean(),
              count = 0 :: non_neg_integer(),
              bytes = 0 :: non_neg_integer()}).

request(S) ->
    request(S, erlang:monotonic_time(millisecond) + ?REQUEST_MS, true).

request(S, Deadline, SkipEmpty) ->
    case recv(S, Deadline) of
        {ok, {http_request, Method, Target, Version}} ->
            %% HTTP/1.0: one request per connection.
            headers(S, Deadline, #req{method = Method, target = Target,
                                      close = Version =/= {1, 1}});
        {ok, {http_error, Empty}} when SkipEmpty, Empty =:= <<"\r\n">>;
                                       SkipEmpty, Empty =:= <<"\n">> ->
            %% RFC 9112 2.2: one empty line before a request is ignored.
            request(S, Deadline, false);
        {ok, _} ->
            refuse(S, 400);
        {error, emsgsize} ->
            refuse(S, 414);
        {error, _} ->
            %% Idle past the deadline, or gone.
            gen_tcp:close(S)
    end.

headers(S, Deadline, R) ->
    case recv(S, Deadline) of
        {ok, {http_header, _, Name, RawName, Value}} ->
            #req{count = N, bytes = B} = R,
            R1 = R#req{count = N + 1, bytes = B + byte_size(RawName) + byte_size(Value)},
            case R1 of
                #req{count = N1, bytes = B1} when N1 > ?MAX_HEADERS;
                                                  B1 > ?MAX_HEADER_BYTES ->
                    refuse(S, 431);
                _ ->
                    headers(S, Deadline, header(Name, Value, R1))
            end;
        {ok, http_eoh} ->
            respond(S, R);
        {ok, _} ->
            refuse(S, 400);
        {error, emsgsize} ->
            refuse(S, 431);
        {error, _} ->
            gen_tcp:close(S)
    end.

header('Content-Length', V, R) ->
    Body = try binary_to_integer(string:trim(V)) =/= 0 catch error:badarg -> true end,
    R#req{body = R#req.body orelse Body};
header('Transfer-Encoding', _, R) ->
    R#req{body = true};
header('Connection', V, R) ->
    Tokens = [string:trim(T) || T <- binary:split(string:lowercase(V), <<",">>, [global])],
    Close = lists:member(<<"close">>, Tokens),
    R#req{close = R#req.close orelse Close};
header(_, _, R) ->
    R.

respond(S, #req{method = M}) when M =/= 'GET', M =/= 'HEAD' ->
    refuse(S, 405, [{"allow", "GET, HEAD"}]);
respond(S, #req{body = true}) ->
    refuse(S, 413, []);
respond(S, #req{method = M, target = Target, close = Close}) ->
    {Code, Headers, Body} =
        case lists:member(path(Target), [<<"/metrics">>, <<"/metrics/">>]) of
            true ->
                {200, [{"content-type", actor_pool_metrics:content_type()}],
                 iolist_to_binary(actor_pool_metrics:render())};
            false ->
                {404, [{"content-type", "text/plain"}],
                 <<"not found: metrics are at /metrics\n">>}
        end,
    Head = head(Code, Headers, Body, Close),
    case gen_tcp:send(S, case M of 'HEAD' -> Head; 'GET' -> [Head, Body] end) of
        ok when not Close -> request(S);
        _ -> gen_tcp:close(S)
    end.

%% The path of the request target, without its query.
path({abs_path, P}) -> hd(binary:split(P, <<"?">>));
path({absoluteURI, _Scheme, _Host, _Port, P}) -> hd(binary:split(P, <<"?">>));
path(_) -> undefined.

%% Answers Code and closes, reading nothing more: what the client sent
%% past this point (a body, more headers) is never read.
refuse(S, Code) ->
    refuse(S, Code, []).

refuse(S, Code, Headers) ->
    Body = [reason(Code), $\n],
    _ = gen_tcp:send(S, [head(Code, [{"content-type", "text/plain"} | Headers], Body, true),
                         Body]),
    gen_tcp:close(S).

%% The status line and headers of an answer with Body.
head(Code, Headers, Body, Close) ->
    ["HTTP/1.1 ", integer_to_list(Code), $\s, reason(Code), "\r\n",
     [[K, ": ", V, "\r\n"] || {K, V} <- Headers],
     "content-length: ", integer_to_list(iolist_size(Body)), "\r\n",
     ["connection: close\r\n" || Close],
     "\r\n"].

reason(200) -> "OK";
reason(400) -> "Bad Request";
reason(404) -> "Not Found";
reason(405) -> "Method Not Allowed";
reason(413) -> "Content Too Large";
reason(414) -> "URI Too Long";
reason(431) -> "Request Header Fields Too Large";
reason(503) -> "Service Unavailable".

recv(S, Deadline) ->
    gen_tcp:recv(S, 0, max(0, Deadline - erlang:monotonic_time(millisecond))).
