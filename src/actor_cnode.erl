%% Over 700 lines, kept whole: one gen_server that owns one OS process
%% through its incarnations (start, the port's packets, exits, backoff); the
%% option checks (actor_cnode_opts) and the OS-process probes
%% (actor_cnode_os) are modules of their own.

%% @doc Owner of one C node: starts it, watches it, restarts it, stops it.
%%
%% A C node is an OS process from `priv/' that speaks the Erlang distribution
%% protocol. This gen_server owns it through a port that carries only the
%% start-up configuration, readiness and log lines; everything else goes over
%% distributed Erlang. The contract is docs/cnode-port-protocol.md:
%%
%% <ol>
%% <li>open the executable with `{packet, 4}' and `["--port"]', the I/O
%%     backend in the environment (`ACTOR_POOL_IO');</li>
%% <li>write one packet, `term_to_binary(Config)' (node name, cookie, parent
%%     node, a fresh creation, limits): the cookie is never in argv;</li>
%% <li>wait for `{ready, Map}', sent once the C node is in epmd and connected
%%     to this node; `{log, Level, Msg}' packets go to `logger'.</li>
%% </ol>
%%
%% `start_link/1' returns only once the C node is ready. When the C node exits
%% on its own (crash, `kill -9') the owner logs it, reports `down' and starts a
%% new incarnation after `min(max_ms, min_ms * 2^n) * U(0.5, 1.0)' ms; `n'
%% counts failed incarnations and resets once one stayed up `stable_ms'. A
%% restarted C node that does not get ready in `start_timeout_ms' is killed
%% and counts as a failure.
%%
%% Stopping closes the port: the C node reads EOF on stdin, unregisters from
%% epmd and exits. A closed port sends no `exit_status', so the owner polls the
%% OS process for up to 2 s and then kills it with `kill -9'.
%%
%% No process is ever linked to the C node: a link to a C node kills the BEAM
%% side when the C node dies. The owner only monitors the connection
%% (`erlang:monitor_node/2') to log disconnects.

%% The owner process alone: options are checked and resolved in
%% actor_cnode_opts; the OS process is waited for, killed and cleaned up
%% after in actor_cnode_os.
-module(actor_cnode).
-behaviour(gen_server).

%% node/1 is part of the API; node/0 below is still the BIF.
-compile({no_auto_import, [node/1]}).

%% API.
-export([start_link/1]).
-export([start/1]).
-export([stop/1]).
-export([info/1]).
-export([node/1]).
-export([await_up/2]).
-export([restart/1]).
-export([shm_name/1]).

%% proc_lib entry point.
-export([init_it/1]).

%% gen_server callbacks.
-export([init/1]).
-export([handle_call/3]).
-export([handle_cast/2]).
-export([handle_info/2]).
-export([terminate/2]).

-export_type([opts/0, ref/0, io/0, status/0, info/0]).

-type io() :: auto | uring | epoll.
-type status() :: up | down | starting.
-type ref() :: pid() | atom().
%% The owner's pid, or the local name given with the `register' option.

-type opts() :: #{exe := string() | binary(),
                  name => string() | binary() | atom(),
                  io => io(),
                  max_frame => pos_integer(),
                  idle_timeout_ms => pos_integer(),
                  listen_ip => inet:ip4_address() | any,
                  handshake_timeout_ms => 1..3600000,
                  max_handshakes => 1..65536,
                  max_handshakes_per_source => 1..65536,
                  args => [string() | binary()],
                  backoff => #{min_ms => pos_integer(), max_ms => pos_integer()},
                  stable_ms => non_neg_integer(),
                  start_timeout_ms => pos_integer(),
                  register => atom(),
                  notify => atom() | pid(),
                  shm => boolean()}.
%% Options of {@link start_link/1}. Only `exe' is required; the others default
%% to the application environment of `actor_pool'.
%%
%% `listen_ip' is the interface the C node accepts distribution connections
%% on: by default the BEAM's own (`kernel' `inet_dist_use_interface', when an
%% IPv4 address: C nodes speak IPv4 only), else `actor_pool' `cnode_listen_ip',
%% else `any'. `max_frame' (bytes, default 64 MiB) is at least 65536: a
%% smaller one is `{error, {badarg, {max_frame, N}}}'. Handshakes need no cookie to
%% start, so they are bounded: `handshake_timeout_ms' for a whole handshake
%% (default 5000, below the BEAM's `net_setuptime'), `max_handshakes' pending
%% at once (default 256) and `max_handshakes_per_source' from one address
%% (default 64); at the overall cap the oldest pending one of the address
%% holding the most is dropped, at the per-address cap that address's
%% oldest. `notify' names a process (a pid, or a registered name looked up
%% at each event) that gets
%% `{actor_cnode, Owner, Node, up | down}' whenever an incarnation becomes
%% ready or is gone; a name that is not registered at that moment gets
%% nothing.
%%
%% `shm' (default false): the C node writes a shared-memory segment (the
%% receptionist's snapshot). The owner names it, {@link shm_name/1}, passes
%% that as `--shm' (after `args', so it wins), and unlinks it when an
%% incarnation dies without doing so itself (a crash, `kill -9', a kill for
%% not getting ready or not stopping), through {@link actor_nif:remove_segment/1}:
%% only if no writer holds the segment's lock, so a live writer's segment
%% (a next incarnation's included) is left alone.

-type info() :: #{node := node(),
                  os_pid := non_neg_integer() | undefined,
                  io := uring | epoll | undefined,
                  status := status(),
                  restarts := non_neg_integer(),
                  port := inet:port_number() | undefined,
                  max_frame := pos_integer()}.
%% `os_pid', `io' and `port' (the C node's distribution port) describe the
%% running incarnation; `os_pid' and `port' are `undefined' while it is down.
%% `max_frame' is the largest distribution frame the C node delivers (the
%% option, or its default).

%% How long terminate/2 waits for the C node to exit after closing the port.
-define(STOP_WAIT_MS, 2000).
%% How long a killed incarnation's last log lines are waited for.
-define(LAST_LOGS_MS, 500).
-define(LOG_LEVELS, [emergency, alert, critical, error, warning, notice, info,
                     debug]).
%% Log lines from the C node that reach `logger', per level and window: the
%% C node limits its own lines, but an owner must not let any child (an
%% older or a foreign executable) flood logger. What is dropped is counted
%% and logged as one line when the window ends.
-define(LOG_WINDOW_MS, 1000).
-define(LOG_PER_WINDOW, 50).
%% Where POSIX shared-memory names live (Linux), for log lines.
-define(SHM_DIR, "/dev/shm").

-record(state, {
    %% validated options, all keys present (see defaults/0)
    opts :: map(),
    %% absolute path of the executable
    exe :: file:filename(),
    %% full node name of the C node, fixed for the life of the owner
    node :: node(),
    %% backend requested from the C node: "auto" | "uring" | "epoll"
    io_request :: string(),
    %% the port of the current incarnation, undefined while down
    port :: port() | undefined,
    os_pid :: non_neg_integer() | undefined,
    %% backend the C node reported in its ready packet
    io :: uring | epoll | undefined,
    %% distribution port the C node reported
    dist_port :: inet:port_number() | undefined,
    status = starting :: status(),
    %% incarnations started after the first one
    restarts = 0 :: non_neg_integer(),
    %% exponent of the next backoff delay
    failures = 0 :: non_neg_integer(),
    %% monotonic ms when the current incarnation reported ready
    up_since :: integer() | undefined,
    %% restart or start-timeout timer, with the message it sends
    timer :: {reference(), term()} | undefined,
    %% monitor_node/2 is on for node
    monitoring = false :: boolean(),
    %% await_up/2 callers: {From, TimerRef}
    waiters = [] :: [{gen_server:from(), reference()}],
    %% C-node log lines per level in the current window:
    %% {WindowStartMs, Logged, Dropped}
    logs = #{} :: #{logger:level() => {integer(), non_neg_integer(), non_neg_integer()}}
}).

%% ===================================================================
%% API
%% ===================================================================

%% @doc Starts an owner linked to the caller and its C node.
%%
%% Returns `{ok, Pid}' once the C node reported ready, `{error, {badarg,
%% {Key, Value}}}' for a bad option (every key is checked, unknown keys too),
%% or `{error, {cnode_start_failed, Reason}}' if the C node did not start in
%% `start_timeout_ms' (its OS process is then killed). Starts distribution
%% first if this node is not distributed.
-spec start_link(opts()) -> {ok, pid()} | {error, term()}.
start_link(Opts) ->
    case actor_cnode_opts:validate(Opts) of
        {ok, Valid} -> proc_lib:start_link(?MODULE, init_it, [Valid]);
        {error, _} = Error -> Error
    end.

%% @doc Starts an owner under `actor_cnode_sup' (the application must run).
%%
%% Same options and results as {@link start_link/1}. The owner is restarted
%% by the supervisor if it crashes, and is gone for good after {@link stop/1}.
-spec start(opts()) -> {ok, pid()} | {error, term()}.
start(Opts) ->
    case actor_cnode_opts:validate(Opts) of
        {ok, _} -> actor_cnode_sup:start_child(Opts);
        {error, _} = Error -> Error
    end.

%% @doc Stops the owner and its C node; returns when the OS process is gone.
-spec stop(ref()) -> ok.
stop(Ref) ->
    gen_server:stop(Ref, normal, infinity).

%% @doc Describes the C node: name, OS pid, I/O backend, status, restarts
%% and distribution port.
-spec info(ref()) -> info().
info(Ref) ->
    gen_server:call(Ref, info).

%% @doc The C node's full node name (the same across restarts).
-spec node(ref()) -> node().
node(Ref) ->
    gen_server:call(Ref, node).

%% @doc Waits until the C node is up, at most `TimeoutMs' milliseconds.
-spec await_up(ref(), non_neg_integer()) -> ok | {error, timeout}.
await_up(Ref, TimeoutMs) when is_integer(TimeoutMs), TimeoutMs >= 0 ->
    gen_server:call(Ref, {await_up, TimeoutMs}, infinity).

%% @doc The POSIX shared-memory name of the segment of C node `Node' when
%% started with `shm' (`"/actor_pool." ++ Node', also the receptionist C
%% node's default).
-spec shm_name(node()) -> string().
shm_name(Node) ->
    "/actor_pool." ++ atom_to_list(Node).

%% @doc Kills the running incarnation (kill -9) so that it is restarted like
%% a crashed one: `down' now, a new incarnation after the backoff. For a
%% user that finds the C node out of step (its connection dropped, a call
%% timed out). `ok' also when it is down already.
-spec restart(ref()) -> ok.
restart(Ref) ->
    gen_server:call(Ref, restart).

%% ===================================================================
%% gen_server callbacks
%% ===================================================================

%% @private
%% The process starts here rather than in gen_server:start_link/3: on OTP 25
%% a failing init/1 makes gen_server exit with the failure as reason, which
%% kills a linked caller that does not trap exits. Here a failed start is
%% acknowledged as {error, _} and the process leaves with reason normal.
-spec init_it(map()) -> no_return().
init_it(Opts) ->
    case register_owner(maps:get(register, Opts)) of
        {ok, ServerName} ->
            case init(Opts) of
                {ok, State} ->
                    proc_lib:init_ack({ok, self()}),
                    case ServerName of
                        undefined -> gen_server:enter_loop(?MODULE, [], State);
                        _ -> gen_server:enter_loop(?MODULE, [], State, ServerName)
                    end;
                {stop, Reason} ->
                    proc_lib:init_ack({error, Reason}),
                    exit(normal)
            end;
        {error, _} = Error ->
            proc_lib:init_ack(Error),
            exit(normal)
    end.

register_owner(undefined) ->
    {ok, undefined};
register_owner(Name) ->
    try register(Name, self()) of
        true -> {ok, {local, Name}}
    catch
        error:badarg -> {error, {already_started, whereis(Name)}}
    end.

%% Opens the C node and waits until it is ready (see init_it/1).
-spec init(map()) -> {ok, #state{}} | {stop, {cnode_start_failed, term()}}.
init(Opts) ->
    %% Trap exits so that terminate/2 runs on a supervisor shutdown and the
    %% port's own EXIT does not take the owner down.
    process_flag(trap_exit, true),
    case prepare(Opts) of
        {ok, State0} ->
            Deadline = erlang:monotonic_time(millisecond)
                + maps:get(start_timeout_ms, Opts),
            try open(State0) of
                State -> await_ready(State, Deadline)
            catch
                error:Reason ->
                    {stop, {cnode_start_failed, {open_port, Reason}}}
            end;
        {error, Reason} ->
            {stop, {cnode_start_failed, Reason}}
    end.

-spec handle_call(term(), gen_server:from(), #state{}) ->
    {reply, term(), #state{}} | {noreply, #state{}}.
handle_call(info, _From, State) ->
    {reply, info_map(State), State};
handle_call(node, _From, #state{node = Node} = State) ->
    {reply, Node, State};
handle_call({await_up, _}, _From, #state{status = up} = State) ->
    {reply, ok, State};
handle_call({await_up, TimeoutMs}, From, #state{waiters = Waiters} = State) ->
    TRef = erlang:start_timer(TimeoutMs, self(), {await_up, From}),
    {noreply, State#state{waiters = [{From, TRef} | Waiters]}};
handle_call(restart, _From, #state{port = undefined} = State) ->
    {reply, ok, State};
handle_call(restart, _From, #state{node = Node} = State0) ->
    logger:warning("actor_cnode ~ts: restart requested; killing the running incarnation", [Node]),
    State = kill(monitor_node_off(cancel_timer(State0))),
    {reply, ok, start_failed(State)};
handle_call(Request, _From, State) ->
    {reply, {error, {unknown_call, Request}}, State}.

-spec handle_cast(term(), #state{}) -> {noreply, #state{}}.
handle_cast(Msg, State) ->
    logger:warning("actor_cnode ~ts: unexpected cast ~0p",
                   [State#state.node, Msg]),
    {noreply, State}.

-spec handle_info(term(), #state{}) -> {noreply, #state{}}.
handle_info({Port, {data, Data}}, #state{port = Port} = State) ->
    {noreply, packet(Data, State)};
handle_info({Port, {exit_status, Status}}, #state{port = Port} = State) ->
    {noreply, exited(Status, State)};
handle_info({timeout, TRef, restart}, #state{timer = {TRef, restart}} = State) ->
    {noreply, respawn(State#state{timer = undefined})};
handle_info({timeout, TRef, start_timeout},
            #state{timer = {TRef, start_timeout}} = State) ->
    logger:warning("actor_cnode ~ts: not ready after ~b ms; killing it",
                   [State#state.node, opt(start_timeout_ms, State)]),
    {noreply, start_failed(kill(State#state{timer = undefined}))};
handle_info({timeout, TRef, {await_up, From}}, #state{waiters = Waiters} = State) ->
    case lists:keytake(From, 1, Waiters) of
        {value, {From, TRef}, Rest} ->
            gen_server:reply(From, {error, timeout}),
            {noreply, State#state{waiters = Rest}};
        _ ->
            {noreply, State}
    end;
handle_info({log_window_end, Level, Start}, State) ->
    {noreply, log_window_end(Level, Start, State)};
handle_info({nodedown, Node}, #state{node = Node} = State) ->
    %% Only logged: the port tells whether the OS process is gone.
    logger:warning("actor_cnode ~ts: connection to the C node lost", [Node]),
    {noreply, State#state{monitoring = false}};
handle_info({'EXIT', Port, Reason}, #state{port = Port} = State) when is_port(Port) ->
    %% The live incarnation's port broke (see port_closed/2): it is gone
    %% like one that exited, and the next one follows after the backoff.
    {noreply, start_failed(port_closed(Reason, monitor_node_off(cancel_timer(State))))};
handle_info({'EXIT', Port, _Reason}, State) when is_port(Port) ->
    %% A port closes after its exit_status, or after we closed it.
    {noreply, State};
handle_info({Port, _}, State) when is_port(Port) ->
    %% Late data from an incarnation we already closed.
    {noreply, State};
handle_info(Msg, State) ->
    logger:warning("actor_cnode ~ts: unexpected message ~0p",
                   [State#state.node, Msg]),
    {noreply, State}.

-spec terminate(term(), #state{}) -> ok.
terminate(_Reason, State) ->
    _ = shutdown(State),
    ok.

%% ===================================================================
%% Options (checked and resolved by actor_cnode_opts)
%% ===================================================================

opt(Key, #state{opts = Opts}) ->
    maps:get(Key, Opts).

%% ===================================================================
%% Starting an incarnation
%% ===================================================================

%% Everything that does not change between incarnations.
prepare(Opts) ->
    case actor_dist:ensure_distributed() of
        ok ->
            Exe = actor_cnode_opts:executable(maps:get(exe, Opts)),
            case filelib:is_regular(Exe) of
                true ->
                    {ok, #state{opts = Opts,
                                exe = Exe,
                                node = actor_cnode_opts:node_name(Opts),
                                io_request = actor_cnode_opts:io_request(maps:get(io, Opts))}};
                false ->
                    {error, {no_executable, Exe}}
            end;
        {error, Reason} ->
            {error, {not_distributed, Reason}}
    end.

%% Fresh for every incarnation, so pids of an old one never match a new one.
%% ei adds 0xE10000 to creations below 4; keep them out of that range.
creation() ->
    Mixed = erlang:unique_integer([positive])
        bxor os:system_time()
        bxor rand:uniform(16#FFFFFFFF),
    case Mixed band 16#FFFFFFFF of
        C when C >= 4 -> C;
        _ -> creation()
    end.

open(#state{opts = Opts, exe = Exe, node = Node} = State) ->
    Port = open_port({spawn_executable, Exe},
                     [{packet, 4}, binary, exit_status, use_stdio,
                      {args, ["--port"]},
                      {env, [{"ACTOR_POOL_IO", State#state.io_request}]}]),
    OsPid = case erlang:port_info(Port, os_pid) of
                {os_pid, P} -> P;
                undefined -> undefined
            end,
    Config = #{node => atom_to_binary(Node, utf8),
               cookie => atom_to_binary(erlang:get_cookie(), utf8),
               parent => atom_to_binary(erlang:node(), utf8),
               creation => creation(),
               max_frame => maps:get(max_frame, Opts),
               idle_timeout_ms => maps:get(idle_timeout_ms, Opts),
               handshake_timeout_ms => maps:get(handshake_timeout_ms, Opts),
               max_handshakes => maps:get(max_handshakes, Opts),
               max_handshakes_per_source => maps:get(max_handshakes_per_source, Opts),
               listen => listen_config(maps:get(listen_ip, Opts)),
               args => maps:get(args, Opts) ++ shm_args(State)},
    %% If the C node died already, the exit_status message will tell.
    _ = (catch port_command(Port, term_to_binary(Config))),
    State#state{port = Port, os_pid = OsPid, status = starting,
                dist_port = undefined, up_since = undefined}.

shm_args(#state{opts = #{shm := true}, node = Node}) ->
    [<<"--shm">>, unicode:characters_to_binary(shm_name(Node))];
shm_args(#state{}) ->
    [].

%% The C node takes a dotted address; <<>> means every interface.
listen_config(any) -> <<>>;
listen_config(Ip) -> list_to_binary(inet:ntoa(Ip)).

%% init/1 blocks until the first incarnation is ready, so that start_link
%% returns {ok, Pid} only for a running C node.
await_ready(#state{port = Port} = State, Deadline) ->
    Remaining = max(0, Deadline - erlang:monotonic_time(millisecond)),
    receive
        {Port, {data, Data}} ->
            case packet(Data, State) of
                #state{status = up} = Up -> {ok, Up};
                Starting -> await_ready(Starting, Deadline)
            end;
        {Port, {exit_status, Status}} ->
            logger:warning("actor_cnode ~ts: exited with status ~b before "
                           "it was ready", [State#state.node, Status]),
            {stop, {cnode_start_failed, {exit_status, Status}}};
        {'EXIT', Port, Reason} ->
            _ = port_closed(Reason, State),
            {stop, {cnode_start_failed, {port_closed, Reason}}}
    after Remaining ->
        logger:warning("actor_cnode ~ts: not ready after ~b ms; killing it",
                       [State#state.node, opt(start_timeout_ms, State)]),
        _ = kill(State),
        {stop, {cnode_start_failed, timeout}}
    end.

%% A new incarnation after a crash: asynchronous, unlike the first one.
respawn(#state{restarts = Restarts} = State) ->
    logger:notice("actor_cnode ~ts: restarting the C node", [State#state.node]),
    try open(State#state{restarts = Restarts + 1}) of
        Opened ->
            TRef = erlang:start_timer(opt(start_timeout_ms, State), self(),
                                      start_timeout),
            Opened#state{timer = {TRef, start_timeout}}
    catch
        error:Reason ->
            logger:error("actor_cnode ~ts: cannot start ~ts: ~0p",
                         [State#state.node, State#state.exe, Reason]),
            start_failed(State#state{restarts = Restarts + 1})
    end.

%% ===================================================================
%% Packets from the C node
%% ===================================================================

packet(Data, State) ->
    packet(Data, State, live).

%% A dying incarnation's (kill/1 reads its last lines): its `ready' is
%% not news.
packet(Data, #state{node = Node} = State, Incarnation) ->
    %% Our own child wrote it; not `safe', its node name may be a new atom.
    try binary_to_term(Data) of
        {ready, #{} = Ready} when Incarnation =:= live ->
            ready(Ready, State);
        {ready, #{}} ->
            State;
        {log, Level, Msg} ->
            log(Level, Msg, State);
        Other ->
            logger:warning("actor_cnode ~ts: unknown packet ~0P",
                           [Node, Other, 20]),
            State
    catch
        error:badarg ->
            logger:warning("actor_cnode ~ts: undecodable packet of ~b bytes",
                           [Node, byte_size(Data)]),
            State
    end.

log(Level, Msg, #state{node = Node, logs = Logs} = State) ->
    Level1 = case lists:member(Level, ?LOG_LEVELS) of
                 true -> Level;
                 false -> notice
             end,
    Now = erlang:monotonic_time(millisecond),
    {Start, Logged, Dropped} =
        case maps:get(Level1, Logs, none) of
            {S, _, D} = W when Now - S >= ?LOG_WINDOW_MS ->
                _ = D > 0 andalso log_dropped(Level1, W, Node),
                {Now, 0, 0};
            none ->
                {Now, 0, 0};
            W ->
                W
        end,
    case Logged < ?LOG_PER_WINDOW of
        true ->
            Text = case is_binary(Msg) of
                       true -> Msg;
                       false -> io_lib:format("~0p", [Msg])
                   end,
            logger:log(Level1, "~ts", [Text], #{cnode => Node}),
            State#state{logs = Logs#{Level1 => {Start, Logged + 1, Dropped}}};
        false ->
            %% The first line dropped in a window sets the timer that
            %% reports the count, should no later line do it.
            _ = Dropped =:= 0 andalso
                erlang:send_after(Start + ?LOG_WINDOW_MS - Now, self(),
                                  {log_window_end, Level1, Start}),
            State#state{logs = Logs#{Level1 => {Start, Logged, Dropped + 1}}}
    end.

log_dropped(Level, {_Start, _Logged, Dropped}, Node) ->
    logger:log(Level, "actor_cnode ~ts: ~b log lines from the C node suppressed "
               "(more than ~b a second)", [Node, Dropped, ?LOG_PER_WINDOW],
               #{cnode => Node}).

%% A window that dropped lines ended: report them, unless a later line did.
log_window_end(Level, Start, #state{node = Node, logs = Logs} = State) ->
    case maps:get(Level, Logs, none) of
        {Start, _, Dropped} = W when Dropped > 0 ->
            log_dropped(Level, W, Node),
            State#state{logs = maps:remove(Level, Logs)};
        _ ->
            State
    end.

ready(Ready, #state{node = Node} = State0) ->
    State = cancel_timer(State0),
    Reported = maps:get(node, Ready, Node),
    _ = Reported =:= Node orelse
        logger:warning("actor_cnode ~ts: C node calls itself ~0p",
                       [Node, Reported]),
    Io = maps:get(io, Ready, undefined),
    DistPort = maps:get(port, Ready, undefined),
    OsPid = case maps:get(os_pid, Ready, State#state.os_pid) of
                P when is_integer(P) -> P;
                _ -> State#state.os_pid
            end,
    logger:notice("actor_cnode ~ts: up (os pid ~0p, io ~0p, port ~0p)",
                  [Node, OsPid, Io, DistPort]),
    Monitoring = State#state.monitoring orelse monitor_node_on(Node),
    lists:foreach(fun({From, TRef}) ->
                          _ = erlang:cancel_timer(TRef),
                          gen_server:reply(From, ok)
                  end, State#state.waiters),
    notify(up, State),
    State#state{status = up, io = Io, dist_port = DistPort, os_pid = OsPid,
                up_since = erlang:monotonic_time(millisecond),
                monitoring = Monitoring, waiters = []}.

notify(Event, #state{node = Node} = State) ->
    Msg = {actor_cnode, self(), Node, Event},
    case opt(notify, State) of
        undefined -> ok;
        Pid when is_pid(Pid) -> Pid ! Msg, ok;
        Name ->
            case whereis(Name) of
                undefined -> ok;
                Pid -> Pid ! Msg, ok
            end
    end.

%% The C node connected to us before it said ready, so this only fails if
%% it is gone already; the port will tell.
monitor_node_on(Node) ->
    try erlang:monitor_node(Node, true) of
        true -> true
    catch
        error:badarg -> false
    end.

monitor_node_off(#state{monitoring = false} = State) ->
    State;
monitor_node_off(#state{node = Node} = State) ->
    _ = (catch erlang:monitor_node(Node, false)),
    receive {nodedown, Node} -> ok after 0 -> ok end,
    State#state{monitoring = false}.

%% ===================================================================
%% Exits, backoff, shutdown
%% ===================================================================

exited(Status, #state{node = Node} = State0) ->
    logger:warning("actor_cnode ~ts: C node exited with status ~b",
                   [Node, Status]),
    %% Drop the connection monitor now, so that a late nodedown of this
    %% incarnation cannot be taken for one of the next.
    State = monitor_node_off(cancel_timer(State0)),
    remove_shm(State),
    start_failed(State#state{port = undefined}).

%% The port broke instead of reporting an exit status: writing the
%% configuration failed with epipe because the C node had already closed
%% its end (it exited at once, and erl_child_setup had not yet reported its
%% status; the status is lost with the port). Make sure the process is
%% gone, as on stop.
port_closed(Reason, #state{node = Node} = State) ->
    logger:warning("actor_cnode ~ts: its port closed (~0p) before an exit "
                   "status came; the C node exited or closed its stdin",
                   [Node, Reason]),
    reap(State).

%% The incarnation is gone (exited, or killed for not getting ready): mark
%% down and schedule the next one.
start_failed(#state{up_since = UpSince, failures = Failures0} = State) ->
    Now = erlang:monotonic_time(millisecond),
    Failures = case UpSince of
                   T when is_integer(T), Now - T >= 0 ->
                       case Now - T >= opt(stable_ms, State) of
                           true -> 0;
                           false -> Failures0
                       end;
                   _ -> Failures0
               end,
    Delay = backoff(opt(backoff, State), Failures),
    logger:notice("actor_cnode ~ts: restart in ~b ms", [State#state.node, Delay]),
    _ = State#state.status =:= up andalso notify(down, State),
    TRef = erlang:start_timer(Delay, self(), restart),
    State#state{status = down, port = undefined, os_pid = undefined,
                dist_port = undefined, up_since = undefined,
                failures = Failures + 1, timer = {TRef, restart}}.

backoff(#{min_ms := Min, max_ms := Max}, N) ->
    Base = min(Max, Min * (1 bsl min(N, 32))),
    max(1, round(Base * (0.5 + rand:uniform() / 2))).

cancel_timer(#state{timer = undefined} = State) ->
    State;
cancel_timer(#state{timer = {TRef, _}} = State) ->
    _ = erlang:cancel_timer(TRef),
    State#state{timer = undefined}.

%% Close the port and make sure the OS process is gone.
shutdown(State0) ->
    State = monitor_node_off(cancel_timer(State0)),
    case State of
        #state{port = undefined} ->
            State;
        #state{port = Port} ->
            _ = (catch port_close(Port)),
            (reap(State))#state{os_pid = undefined, status = down}
    end.

%% The incarnation's port is closed: wait until its OS process has gone
%% (kill -9 after ?STOP_WAIT_MS), then unlink its segment.
reap(#state{os_pid = OsPid, node = Node} = State) ->
    Deadline = erlang:monotonic_time(millisecond) + ?STOP_WAIT_MS,
    case actor_cnode_os:wait_exit(OsPid, Deadline) of
        true -> ok;
        false ->
            logger:warning("actor_cnode ~ts: still running ~b ms after "
                           "its port closed; kill -9", [Node, ?STOP_WAIT_MS]),
            actor_cnode_os:kill(OsPid)
    end,
    remove_shm(State),
    State#state{port = undefined}.

%% Kill the OS process at once (start timeout).
kill(#state{port = Port, os_pid = OsPid} = State0) ->
    actor_cnode_os:kill(OsPid),
    %% Its last log lines (often why it dropped a connection, which is
    %% what got it killed) may still be in the pipe: a port closed now
    %% would lose them. They are read up to its exit status, which comes
    %% as soon as the killed process is reaped.
    State = last_logs(Port, State0, erlang:monotonic_time(millisecond) + ?LAST_LOGS_MS),
    _ = (catch port_close(Port)),
    remove_shm(State),
    State#state{port = undefined}.

last_logs(Port, State, _Deadline) when not is_port(Port) ->
    State;
last_logs(Port, State, Deadline) ->
    receive
        {Port, {data, Data}} ->
            last_logs(Port, packet(Data, State, dying), Deadline);
        {Port, {exit_status, _}} ->
            State
    after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
        State
    end.

%% The incarnation in State is gone: unlink its segment, which a clean
%% exit unlinks itself. Through the NIF, by the rule every party follows
%% (c_src/shm/ap_shm.h, "Writers that are gone"): only an object of ours
%% that no writer holds the lock of, opened without following a symlink or
%% blocking on a FIFO, and only if the name still names it. Never by
%% file:delete/1 or a read here: a FIFO anyone can plant under the name
%% would hang this process, and a name the next writer already holds must
%% stay. Without the NIF the segment is left to the sweep of the next
%% receptionist that starts.
remove_shm(#state{opts = #{shm := false}}) ->
    ok;
remove_shm(#state{os_pid = undefined}) ->
    ok;
remove_shm(#state{node = Node, os_pid = OsPid}) ->
    Name = shm_name(Node),
    Deadline = erlang:monotonic_time(millisecond) + ?STOP_WAIT_MS,
    try actor_cnode_os:remove_segment(unicode:characters_to_binary(Name), Deadline) of
        ok ->
            logger:notice("actor_cnode ~ts: removed the segment ~ts~ts of the C node "
                          "that died (os pid ~b)", [Node, ?SHM_DIR, Name, OsPid]);
        {error, enoent} ->
            ok;
        {error, Reason} ->
            logger:warning("actor_cnode ~ts: left the segment ~ts~ts alone: ~0p",
                           [Node, ?SHM_DIR, Name, Reason])
    catch
        error:Reason ->
            logger:warning("actor_cnode ~ts: cannot remove the segment ~ts~ts (~0p); "
                           "the next receptionist to start sweeps it",
                           [Node, ?SHM_DIR, Name, Reason])
    end.

info_map(#state{} = State) ->
    #{node => State#state.node,
      os_pid => State#state.os_pid,
      io => State#state.io,
      status => State#state.status,
      restarts => State#state.restarts,
      port => State#state.dist_port,
      max_frame => maps:get(max_frame, State#state.opts)}.
