%% A C node under abuse that needs no cookie, or only the cookie: clients
%% that hold every fd it may open, a flood of failed handshakes, a child that
%% floods its owner with log packets, and connections that announce huge
%% frames. The node must stay near idle, keep its logs bounded and its
%% memory small, and serve once the abuse stops.
%%
%% The echo node from priv/ (or ACTOR_POOL_ECHO_EXE, an absolute path), with
%% the I/O backend of ACTOR_POOL_IO (uring | epoll); `make test' runs this
%% module once with each. Every C node, client and peer process started here
%% is stopped by its OS pid, and its epmd name is gone before a case ends.
-module(actor_cnode_abuse_tests).

-import(ap_test_util, [alive/1, echo_exe/0, abs_exe/1]).
-import(ap_support, [wait_until/2, epmd_names/0, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

%% The cases, called through ?MODULE.
-export([clients_over_the_fd_limit_leave_the_node_idle_and_it_recovers/1,
         failed_handshakes_make_a_bounded_number_of_logger_events/1,
         the_owner_bounds_log_packets_from_its_child/1,
         announced_frame_lengths_reserve_no_memory/1,
         a_peer_that_stops_reading_is_cut_off_with_bounded_memory/1]).

-define(CALL_TIMEOUT, 5000).
-define(WAIT_MS, 30000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_cnode_abuse_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [clients_over_the_fd_limit_leave_the_node_idle_and_it_recovers,
                          failed_handshakes_make_a_bounded_number_of_logger_events,
                          the_owner_bounds_log_packets_from_its_child,
                          announced_frame_lengths_reserve_no_memory,
                          a_peer_that_stops_reading_is_cut_off_with_bounded_memory]]
     end}.

setup() ->
    WasAlive = ap_test_util:start_app(),
    Dir = ap_test_util:temp_dir("actor_cnode_abuse_tests"),
    CookieFile = filename:join(Dir, "cookie"),
    ok = file:write_file(CookieFile, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(CookieFile, 8#600),
    #{was_alive => WasAlive, dir => Dir, cookie_file => CookieFile}.

cleanup(#{was_alive := WasAlive, dir := Dir}) ->
    _ = file:del_dir_r(Dir),
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Cases
%% ===================================================================

%% Under `ulimit -n 24' (the node holds 10 fds idle), 40 idle clients:
%% accepts fail with EMFILE. The node must not spin on them (CPU over 2 s
%% well under a core) nor log a line per failure, and once the clients
%% leave, a real node connects. Each client has a source address of its
%% own, so that no limit per source keeps the node off its fd limit.
clients_over_the_fd_limit_leave_the_node_idle_and_it_recovers(Ctx) ->
    with_standalone(Ctx, "fdlimit", 24, fun(#{node := N, port := Port, os_pid := OsPid, dist_port := DP}) ->
        Clients = [begin
                       {ok, S} = gen_tcp:connect({127, 0, 0, 1}, DP,
                                                 [binary, {active, false}, {ip, {127, 0, 1, I}}], 5000),
                       S
                   end || I <- lists:seq(1, 40)],
        try
            %% The node ran out of fds: it says so (once).
            _ = await_line(Port, "accept failed", ?WAIT_MS),
            Cpu0 = cpu_ticks(OsPid),
            Lines = count_lines(Port, erlang:monotonic_time(millisecond) + 2000, 0),
            CpuS = (cpu_ticks(OsPid) - Cpu0) / clock_ticks(),
            ?assert(CpuS < 0.2),
            ?assert(Lines < 50)
        after
            [gen_tcp:close(S) || S <- Clients]
        end,
        %% The clients left: this node connects (within a few pings: the
        %% node frees their fds as their handshakes fail) and is served.
        wait_until(fun() -> net_adm:ping(N) =:= pong end, ?WAIT_MS),
        ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT))
    end).

%% 5000 clients connect and close at once: one failed handshake each. The
%% logger events of that C node stay bounded; every failure is still
%% accounted for (a line, or a count in a "suppressed N" line).
failed_handshakes_make_a_bounded_number_of_logger_events(_Ctx) ->
    Alive = alive("hsflood"),
    {ok, Owner} = actor_cnode:start(#{exe => echo_exe(), name => Alive}),
    HandlerId = list_to_atom(Alive ++ "_counter"),
    try
        #{node := N, port := DP} = actor_cnode:info(Owner),
        ok = ap_test_util:add_cnode_log_handler(HandlerId, N),
        [begin
             {ok, S} = gen_tcp:connect({127, 0, 0, 1}, DP, [binary, {active, false}], 5000),
             ok = gen_tcp:close(S)
         end || _ <- lists:seq(1, 5000)],
        Events = await_accounted(N, 5000, erlang:monotonic_time(millisecond) + 60000, []),
        ?assert(length(Events) =< 200),
        %% The C node limited itself (not only its owner): a few summary
        %% lines, not one per connection.
        ?assert(length([E || E <- Events, string:find(text(E), "handshake") =/= nomatch]) =< 20),
        ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
        ?assertEqual(pong, net_adm:ping(N))
    after
        _ = logger:remove_handler(HandlerId),
        ok = actor_cnode:stop(Owner),
        flush_events(),
        wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS)
    end.

%% A child that writes 10000 log packets and never gets ready: the owner
%% passes a bounded number to logger, then kills it at the start timeout.
the_owner_bounds_log_packets_from_its_child(#{dir := Dir}) ->
    Packet = term_to_binary({log, warning, <<"flood">>}),
    Flood = filename:join(Dir, "flood.bin"),
    ok = file:write_file(Flood, binary:copy(<<(byte_size(Packet)):32, Packet/binary>>, 10000)),
    PidFile = filename:join(Dir, "flood.pid"),
    Script = filename:join(Dir, "flooder"),
    ok = file:write_file(Script, ["#!/bin/sh\necho $$ > '", PidFile, "'\n",
                                  "cat '", Flood, "'\nexec cat >/dev/null\n"]),
    ok = file:change_mode(Script, 8#755),
    Alive = alive("logflood"),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    N = list_to_atom(Alive ++ "@" ++ Host),
    HandlerId = list_to_atom(Alive ++ "_counter"),
    ok = ap_test_util:add_cnode_log_handler(HandlerId, N),
    try
        ?assertEqual({error, {cnode_start_failed, timeout}},
                     actor_cnode:start(#{exe => Script, name => Alive,
                                         start_timeout_ms => 3000})),
        {ok, PidText} = file:read_file(PidFile),
        wait_until(fun() -> not os_pid_alive(binary_to_integer(string:trim(PidText))) end, 5000),
        Events = drain_events([]),
        Floods = [E || #{msg := {"~ts", [<<"flood">>]}} = E <- Events],
        ?assert(length(Floods) >= 1),
        ?assert(length(Floods) =< 200)
    after
        _ = logger:remove_handler(HandlerId),
        flush_events()
    end.

%% 20 connections, past a real handshake, each announce a 64 MiB frame and
%% send a few bytes of it. The node's address space grows by what came, not
%% by what was announced (1.25 GiB), and it closes nothing.
announced_frame_lengths_reserve_no_memory(Ctx) ->
    with_standalone(Ctx, "bigframe", unlimited, fun(#{node := N, os_pid := OsPid}) ->
        #{connections := C0} = stats(N),
        Vm0 = vm_size_kib(OsPid),
        %% 64 MiB (the default max_frame), 'p', then the start of a term.
        Hex = "04000000" ++ "70" ++ "8368046400",
        Peers = [rawpeer_hold(Ctx, N, Hex) || _ <- lists:seq(1, 20)],
        try
            [?assertEqual("sent", await_peer_line(P)) || P <- Peers],
            %% All 20 are the node's connections; their bytes came before a
            %% later stats call's.
            wait_until(fun() -> maps:get(connections, stats(N)) >= C0 + 20 end, ?WAIT_MS),
            _ = stats(N),
            GrowthKiB = vm_size_kib(OsPid) - Vm0,
            ?assert(GrowthKiB < 64 * 1024),
            ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT))
        after
            [stop_rawpeer(P) || P <- Peers]
        end
    end).

%% A peer that sends calls and never reads the replies: 3000 calls of
%% 32 KiB (96 MiB of replies) to a node with a max_frame of 1 MiB. Once
%% more than 64 MiB wait unwritten and none has gone out for a while, the
%% node closes that connection with one line, its memory stays bounded,
%% and it serves everyone else.
a_peer_that_stops_reading_is_cut_off_with_bounded_memory(Ctx) ->
    with_standalone(Ctx, "noreader", unlimited, ["--max-frame", "1048576"],
                    fun(#{node := N, port := Port, os_pid := OsPid}) ->
        #{connections := C0} = stats(N),
        Ctl = term_to_binary({6, self(), '', echo}),
        Msg = term_to_binary({'$gen_call', {self(), make_ref()}, rand:bytes(32768)}),
        Frame = <<(1 + byte_size(Ctl) + byte_size(Msg)):32, $p, Ctl/binary, Msg/binary>>,
        Hex = binary_to_list(binary:encode_hex(Frame)),
        Peer = rawpeer_hold(Ctx, N, Hex, ["-n", "-r", "3000"]),
        try
            ?assertEqual("sent", await_peer_line(Peer)),
            Line = await_line(Port, "peer not reading", 60000),
            {match, [Unsent]} = re:run(Line, "([0-9]+) bytes unsent", [{capture, all_but_first, list}]),
            ?assert(list_to_integer(Unsent) > 64 * 1024 * 1024),
            wait_until(fun() -> maps:get(connections, stats(N)) =:= C0 end, ?WAIT_MS),
            ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
            %% Twice the limit may be queued, in buffers that double.
            ?assert(vm_hwm_kib(OsPid) < 512 * 1024)
        after
            stop_rawpeer(Peer)
        end
    end).

%% ===================================================================
%% C-node log events (ap_test_util:add_cnode_log_handler/2)
%% ===================================================================

%% Events of N until the handshake failures they account for reach Want.
await_accounted(N, Want, Deadline, Acc) ->
    case accounted(Acc) >= Want of
        true ->
            Acc;
        false ->
            Remaining = max(0, Deadline - erlang:monotonic_time(millisecond)),
            receive
                {cnode_log, N, Event} -> await_accounted(N, Want, Deadline, [Event | Acc])
            after Remaining ->
                error({accounted, accounted(Acc), length(Acc)})
            end
    end.

%% Failed handshakes an event stands for: the sum of the counts in the C
%% node's "incoming handshakes refused: N timed out, N dropped ...; N closed
%% by the peer" summary (at most one a second), or the N of the owner's "N
%% log lines from the C node suppressed".
accounted(Events) ->
    lists:sum([handshakes(text(E)) || E <- Events]).

handshakes(Text) ->
    case re:run(Text, "([0-9]+) log lines from the C node suppressed",
                [{capture, all_but_first, list}]) of
        {match, [N]} ->
            list_to_integer(N);
        nomatch ->
            case string:prefix(Text, "incoming handshakes refused:") of
                nomatch ->
                    0;
                Counts ->
                    {match, Ns} = re:run(Counts, "[0-9]+", [global, {capture, all, list}]),
                    lists:sum([list_to_integer(N) || [N] <- Ns])
            end
    end.

text(#{msg := {string, S}}) -> unicode:characters_to_list(S);
text(#{msg := {Format, Args}}) when is_list(Args) -> lists:flatten(io_lib:format(Format, Args));
text(_) -> "".

drain_events(Acc) ->
    receive {cnode_log, _, E} -> drain_events([E | Acc])
    after 0 -> lists:reverse(Acc)
    end.

flush_events() ->
    _ = drain_events([]),
    ok.

%% ===================================================================
%% Helpers
%% ===================================================================

%% Runs Fun with a standalone echo node under `ulimit -n Fds' (or no
%% limit), its stderr lines coming to this process; kills it afterwards.
with_standalone(Ctx, Tag, Fds, Fun) ->
    with_standalone(Ctx, Tag, Fds, [], Fun).

with_standalone(#{cookie_file := CookieFile}, Tag, Fds, Args, Fun) ->
    Alive = alive(Tag),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    N = list_to_atom(Alive ++ "@" ++ Host),
    Limit = case Fds of
                unlimited -> "";
                _ -> "ulimit -n " ++ integer_to_list(Fds) ++ " && "
            end,
    Port = open_port({spawn_executable, "/bin/sh"},
                     [{args, ["-c", Limit ++ "exec \"$0\" \"$@\"", abs_exe(echo_exe()),
                              "--name", atom_to_list(N), "--cookie-file", CookieFile,
                              "--io", io() | Args]},
                      %% One malloc arena: each handshake thread's first
                      %% malloc would otherwise reserve an arena of 64 MiB
                      %% of address space, which is not what the frame
                      %% test measures.
                      {env, [{"MALLOC_ARENA_MAX", "1"}]},
                      {line, 4096}, binary, exit_status, stderr_to_stdout, use_stdio]),
    {os_pid, OsPid} = erlang:port_info(Port, os_pid),
    try
        Ready = await_line(Port, " ready: port ", ?WAIT_MS),
        {match, [DP]} = re:run(Ready, " ready: port ([0-9]+)", [{capture, all_but_first, list}]),
        Fun(#{node => N, port => Port, os_pid => OsPid, dist_port => list_to_integer(DP)})
    after
        _ = os_pid_alive(OsPid) andalso os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
        catch port_close(Port),
        flush_port(Port),
        wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS)
    end.

%% The first line from Port that contains Pattern.
await_line(Port, Pattern, Timeout) ->
    receive
        {Port, {data, {_, Line}}} ->
            case string:find(Line, Pattern) of
                nomatch -> await_line(Port, Pattern, Timeout);
                _ -> Line
            end;
        {Port, {exit_status, S}} ->
            error({exited, S})
    after Timeout ->
        error({no_line, Pattern})
    end.

%% Lines from Port until Deadline.
count_lines(Port, Deadline, N) ->
    Remaining = max(0, Deadline - erlang:monotonic_time(millisecond)),
    receive
        {Port, {data, {eol, _}}} -> count_lines(Port, Deadline, N + 1);
        {Port, {data, {noeol, _}}} -> count_lines(Port, Deadline, N)
    after Remaining ->
        N
    end.

flush_port(Port) ->
    receive {Port, _} -> flush_port(Port)
    after 0 -> ok
    end.

%% utime + stime of an OS process, in clock ticks.
cpu_ticks(OsPid) ->
    {ok, Stat} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/stat"),
    [_, After] = string:split(Stat, ")", trailing),
    Fields = string:lexemes(After, " "),
    %% After the comm field: state is field 3, utime 14 and stime 15.
    binary_to_integer(lists:nth(12, Fields)) + binary_to_integer(lists:nth(13, Fields)).

clock_ticks() ->
    list_to_integer(string:trim(os:cmd("getconf CLK_TCK"))).

vm_hwm_kib(OsPid) ->
    {ok, Status} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/status"),
    {match, [KiB]} = re:run(Status, "VmHWM:\\s+([0-9]+) kB", [{capture, all_but_first, binary}]),
    binary_to_integer(KiB).

vm_size_kib(OsPid) ->
    {ok, Status} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/status"),
    {match, [KiB]} = re:run(Status, "VmSize:\\s+([0-9]+) kB", [{capture, all_but_first, binary}]),
    binary_to_integer(KiB).

%% actor_rawpeer (a test executable) in hold mode: handshakes with Node, writes the bytes,
%% prints "sent" and keeps the connection until its stdin closes.
rawpeer_hold(Ctx, Node, Hex) ->
    rawpeer_hold(Ctx, Node, Hex, []).

%% The same with options before the arguments (-n: never read, -r: repeat).
rawpeer_hold(#{cookie_file := CookieFile}, Node, Hex, Opts) ->
    Exe = ap_support:test_bin("actor_rawpeer"),
    Port = open_port({spawn_executable, Exe},
                     [{args, Opts ++ [atom_to_list(Node), CookieFile, Hex, "hold"]},
                      {line, 256}, binary, exit_status, use_stdio]),
    {os_pid, OsPid} = erlang:port_info(Port, os_pid),
    {Port, OsPid}.

await_peer_line({Port, _}) ->
    receive
        {Port, {data, {eol, Line}}} -> binary_to_list(Line);
        {Port, {exit_status, S}} -> {exited, S}
    after ?WAIT_MS -> timeout
    end.

stop_rawpeer({Port, OsPid}) ->
    catch port_close(Port),
    wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
    flush_port(Port).

stats(N) ->
    Stats = gen_server:call({echo, N}, stats, ?CALL_TIMEOUT),
    ?assert(is_map(Stats)),
    Stats.

io() ->
    case os:getenv("ACTOR_POOL_IO") of
        Io when Io =:= "uring"; Io =:= "epoll" -> Io;
        _ -> "auto"
    end.

