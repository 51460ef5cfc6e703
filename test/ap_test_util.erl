%% @doc Helpers shared by the EUnit modules: pools, peers' collectors, C-node
%% names and executables, hand-made external-format bytes, and the check
%% that a test left no shared-memory segment behind. Polling, OS-process
%% and epmd checks are in support/ap_support.erl (shared with the
%% benchmarks and the demo).
-module(ap_test_util).

-export([with_pool/4, with_env/4, on_rings/1, crash_plugin/0, abs_exe/1]).
-export([ext_atom/1, ext_pid/1, fun_overrun/1, reg_send_frame/3, name_packet/1]).
-export([pool_setup/0, pool_cleanup/1]).
-export([temp_dir/1, start_app/0, stop_app/1, distribution_only/0,
         rcpt_barrier/0, spawn_collector/0, collected/1, priv_dir/0, alive/1, echo_exe/0,
         segment/1, own_segments/0, no_segments_left/0]).
-export([set_env/1, restore_env/1, rawpeer/3, add_cnode_log_handler/2, promtool_check/1]).
-export([log/2]).

%% How long an owner may take to notice its C node's exit and unlink the
%% segment (the C node itself unlinks it on a clean stop).
-define(SEGMENT_WAIT_MS, 20000).

%% A fresh 0700 directory under $TMPDIR (or /tmp), named after Prefix.
-spec temp_dir(string()) -> file:filename().
temp_dir(Prefix) ->
    Base = case os:getenv("TMPDIR") of
               T when is_list(T), T =/= "" -> T;
               _ -> "/tmp"
           end,
    Dir = filename:join(Base, Prefix ++ "_"
                        ++ integer_to_list(erlang:unique_integer([positive]))
                        ++ "_" ++ os:getpid()),
    ok = file:make_dir(Dir),
    ok = file:change_mode(Dir, 8#700),
    Dir.

%% Starts distribution (if needed) and the application; whether the node
%% was distributed before, for stop_app/1. With ACTOR_POOL_TEST_FAST_PATH
%% set to false, the application setting fast_path is false first: every
%% call of this BEAM to a pool node then goes by distribution, the path of
%% a remote caller (make eunit-dist runs the pool suites so).
-spec start_app() -> WasAlive :: boolean().
start_app() ->
    WasAlive = is_alive(),
    ok = actor_dist:ensure_distributed(),
    case distribution_only() of
        true ->
            _ = application:load(actor_pool),
            ok = application:set_env(actor_pool, fast_path, false);
        false -> ok
    end,
    {ok, _} = application:ensure_all_started(actor_pool),
    WasAlive.

%% Whether this run takes the distribution path only (start_app/0).
-spec distribution_only() -> boolean().
distribution_only() ->
    os:getenv("ACTOR_POOL_TEST_FAST_PATH") =:= "false".

%% The pool suites' fixture: the application started, its pool node
%% known; the cleanup stops every pool left, then the application.
-spec pool_setup() -> #{pool_node := node(), was_alive := boolean()}.
pool_setup() ->
    WasAlive = start_app(),
    PoolNode = actor_pool:pool_node(),
    true = is_atom(PoolNode) andalso PoolNode =/= undefined,
    #{pool_node => PoolNode, was_alive => WasAlive}.

-spec pool_cleanup(#{was_alive := boolean(), _ => _}) -> ok.
pool_cleanup(#{was_alive := WasAlive}) ->
    _ = [actor_pool:stop_pool(Pid) || {_, Pid} <- actor_pool:which_pools()],
    stop_app(WasAlive).

%% Stops the application, and distribution too when the test setup started
%% it; fails if a C node of this test node left a segment behind.
-spec stop_app(WasAlive :: boolean()) -> ok.
stop_app(WasAlive) ->
    %% A run on distribution only took that path: no lane was opened.
    Rings = case distribution_only() of
                true -> [L || #{transport := ring} = L <- maps:get(lanes, actor_pool_dp:info())];
                false -> []
            end,
    ok = application:stop(actor_pool),
    case distribution_only() of
        true -> ok = application:unset_env(actor_pool, fast_path);
        false -> ok
    end,
    ok = no_segments_left(),
    case WasAlive of
        true -> ok;
        false -> ok = net_kernel:stop()
    end,
    [] = Rings,
    ok.

%% Everything the receptionist sent before this call has been delivered: a
%% find from this process is answered after it, over the same connection.
-spec rcpt_barrier() -> ok.
rcpt_barrier() ->
    K = actor_receptionist:service_key(<<"$barrier">>),
    ok = actor_receptionist:find(K, self()),
    receive {listing, K, _} -> ok
    after 10000 -> error(barrier_timeout)
    end.

%% A process that keeps what it receives, and hands it over on request
%% (collected/1); `stop' ends it.
-spec spawn_collector() -> pid().
spawn_collector() ->
    spawn(fun() -> collect([]) end).

collect(Acc) ->
    receive
        {'$collected', From} -> From ! {self(), lists:reverse(Acc)}, collect(Acc);
        stop -> ok;
        Msg -> collect([Msg | Acc])
    end.

%% What collector S got so far, in order; call after rcpt_barrier/0.
-spec collected(pid()) -> [term()].
collected(S) ->
    S ! {'$collected', self()},
    receive {S, Msgs} -> Msgs
    after 10000 -> error(collector_timeout)
    end.

%% The application's priv directory (ap_support's, imported by many suites).
-spec priv_dir() -> file:filename().
priv_dir() ->
    ap_support:priv_dir().

%% A C-node alive name unique to this test node and Tag.
-spec alive(string()) -> string().
alive(Tag) ->
    [Alive, _Host] = string:split(atom_to_list(node()), "@"),
    Alive ++ "_" ++ Tag.

%% The echo node's executable: $ACTOR_POOL_ECHO_EXE (a sanitizer build) or
%% the test build (ap_support:test_bin/1).
-spec echo_exe() -> string().
echo_exe() ->
    case os:getenv("ACTOR_POOL_ECHO_EXE") of
        Exe when is_list(Exe), Exe =/= "" -> Exe;
        _ -> ap_support:test_bin("actor_echo_node")
    end.

%% The /dev/shm file of C node Node's snapshot segment.
-spec segment(node()) -> file:filename().
segment(Node) ->
    "/dev/shm" ++ actor_cnode:shm_name(Node).

%% Snapshot segments (/dev/shm/actor_pool.*) of C nodes that this test node
%% started or that its peers started: named after this node's alive name,
%% after a peer:random_name/1 name of this OS process (`Prefix-N-OsPid',
%% then the C node's `_rcpt' suffix), or after the network-namespace peers
%% of the cluster suite (`apns' ++ OsPid rem 100000 ++ a letter). Other
%% test runs on the machine have other names.
-spec own_segments() -> [string()].
own_segments() ->
    [Alive, _Host] = string:split(atom_to_list(node()), "@"),
    OsPid = os:getpid(),
    Peer = "-" ++ OsPid ++ "_",
    Netns = "apns" ++ integer_to_list(list_to_integer(OsPid) rem 100000),
    case file:list_dir("/dev/shm") of
        {ok, Names} ->
            lists:sort([N || "actor_pool." ++ Rest = N <- Names,
                             lists:prefix(Alive ++ "_", Rest)
                                 orelse string:find(Rest, Peer) =/= nomatch
                                 orelse netns_name(Netns, Rest)]);
        {error, _} ->
            []
    end.

netns_name(Prefix, Name) ->
    case lists:prefix(Prefix, Name) of
        true ->
            case lists:nthtail(length(Prefix), Name) of
                [X, $_ | _] when X >= $a, X =< $z -> true;
                _ -> false
            end;
        false ->
            false
    end.

%% Waits until own_segments/0 is empty (owners unlink what a dead C node
%% left once they notice); fails with the names otherwise. Call while this
%% node is still distributed.
-spec no_segments_left() -> ok.
no_segments_left() ->
    case ap_support:poll(fun own_segments/0, fun(Left) -> Left =:= [] end, ?SEGMENT_WAIT_MS) of
        {ok, []} -> ok;
        {timeout, Left} -> error({segments_left_behind, Left})
    end.

%% Fun() with this BEAM's calls to pool nodes on the same-host rings, for
%% a case about the rings themselves: in a run on distribution only
%% (distribution_only/0) the setting fast_path is true for its length.
-spec on_rings(fun(() -> T)) -> T.
on_rings(Fun) ->
    case distribution_only() of
        false ->
            Fun();
        true ->
            try
                with_env(actor_pool, fast_path, true, fun() -> ok = actor_pool_dp:refresh(), Fun() end)
            after
                ok = actor_pool_dp:refresh()
            end
    end.

%% Runs Fun(Pid) with a pool started for it, and stops the pool after.
-spec with_pool(atom(), term(), map(), fun((pid()) -> T)) -> T.
with_pool(Name, Handler, Opts, Fun) ->
    {ok, P} = actor_pool:start_pool(Name, Handler, Opts),
    try
        Fun(P)
    after
        actor_pool:stop_pool(P)
    end.

%% Fun() with application App's Key set to Value, then the key as it was
%% (unset if it was).
-spec with_env(atom(), atom(), term(), fun(() -> T)) -> T.
with_env(App, Key, Value, Fun) ->
    Saved = application:get_env(App, Key),
    ok = application:set_env(App, Key, Value),
    try
        Fun()
    after
        case Saved of
            {ok, V} -> application:set_env(App, Key, V);
            undefined -> application:unset_env(App, Key)
        end
    end.

%% The test plugin that crashes on request (c_src/test/plugin_crash.c).
-spec crash_plugin() -> {plugin, file:filename()}.
crash_plugin() ->
    {plugin, ap_support:test_bin("plugin_crash.so")}.

%% An executable path: as given when absolute, else under priv/.
-spec abs_exe(file:filename()) -> file:filename().
abs_exe(Exe) ->
    case filename:pathtype(Exe) of
        absolute -> Exe;
        _ -> filename:join(priv_dir(), Exe)
    end.

%% ===================================================================
%% Hand-made external-format bytes, for the hostile-input cases
%% ===================================================================

%% An ATOM_UTF8_EXT (no version byte).
-spec ext_atom(atom()) -> binary().
ext_atom(A) ->
    B = atom_to_binary(A, utf8),
    <<119, (byte_size(B)), B/binary>>.

%% A NEW_PID_EXT of node Node.
-spec ext_pid(string()) -> binary().
ext_pid(Node) ->
    B = list_to_binary(Node),
    <<88, 119, (byte_size(B)), B/binary, 1:32, 0:32, 1:32>>.

%% Fun then Pad (two terms, no version byte): Fun has one free variable and
%% a Size 5 bytes past its end, where Pad's content starts with a binary
%% header claiming Claim bytes (the same bytes as c_src/test/t_fun_overrun.h).
-spec fun_overrun(non_neg_integer()) -> binary().
fun_overrun(Claim) ->
    Fields = <<119, 1, $m, 97, 5, 98, 1234:32, (ext_pid("n@h"))/binary>>,
    Body = <<1, (binary:copy(<<16#ab>>, 16))/binary, 5:32, 1:32, Fields/binary, 97, 7>>,
    Fun = <<112, (4 + byte_size(Body) + 5):32, Body/binary>>,
    Inner = <<109, Claim:32, (binary:copy(<<16#5a>>, 8))/binary>>,
    <<Fun/binary, 109, (byte_size(Inner)):32, Inner/binary>>.

%% A REG_SEND frame {6, From, '', ToName} + Msg (Msg with its version
%% byte), From a pid of node Self, with its 4-byte length.
-spec reg_send_frame(string(), atom(), binary()) -> binary().
reg_send_frame(Self, ToName, Msg) ->
    Ctrl = <<131, 104, 4, 97, 6, (ext_pid(Self))/binary, (ext_atom(''))/binary, (ext_atom(ToName))/binary>>,
    Body = <<$p, Ctrl/binary, Msg/binary>>,
    <<(byte_size(Body)):32, Body/binary>>.

%% A well-formed OTP 23+ handshake name packet ('N', flags, creation, name
%% Alive@localhost) with the flags ei requires, with its 2-byte length: it
%% needs no cookie, and a C node answers it with its challenge.
-spec name_packet(string()) -> binary().
name_packet(Alive) ->
    Name = list_to_binary(Alive ++ "@localhost"),
    Body = <<$N, 16#17FFFFFFF:64, 7:32, (byte_size(Name)):16, Name/binary>>,
    <<(byte_size(Body)):16, Body/binary>>.

%% Sets the application's environment (loading it first); what was there
%% before, for restore_env/1.
-spec set_env([{atom(), term()}]) -> [{atom(), {ok, term()} | undefined}].
set_env(Env) ->
    _ = application:load(actor_pool),
    Old = [{K, application:get_env(actor_pool, K)} || {K, _} <- Env],
    [ok = application:set_env(actor_pool, K, V) || {K, V} <- Env],
    Old.

-spec restore_env([{atom(), {ok, term()} | undefined}]) -> ok.
restore_env(Old) ->
    [case V of
         {ok, Value} -> application:set_env(actor_pool, K, Value);
         undefined -> application:unset_env(actor_pool, K)
     end || {K, V} <- Old],
    ok.

%% Runs actor_rawpeer (a test executable: a peer that handshakes with a
%% node and writes raw bytes) with the arguments Args(CookieFile), the
%% cookie this node's; {ExitStatus, Output}. Killed by its OS pid past
%% TimeoutMs.
-spec rawpeer(string(), fun((file:filename()) -> [string()]), pos_integer()) -> {integer(), binary()}.
rawpeer(Prefix, Args, TimeoutMs) ->
    Dir = temp_dir(Prefix),
    CookieFile = filename:join(Dir, "cookie"),
    ok = file:write_file(CookieFile, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(CookieFile, 8#600),
    try
        Port = open_port({spawn_executable, ap_support:test_bin("actor_rawpeer")},
                         [{args, Args(CookieFile)}, exit_status, binary, use_stdio]),
        port_output(Port, <<>>, erlang:monotonic_time(millisecond) + TimeoutMs)
    after
        _ = file:del_dir_r(Dir)
    end.

port_output(Port, Acc, Deadline) ->
    Remaining = max(0, Deadline - erlang:monotonic_time(millisecond)),
    receive
        {Port, {data, Data}} -> port_output(Port, <<Acc/binary, Data/binary>>, Deadline);
        {Port, {exit_status, Status}} -> {Status, Acc}
    after Remaining ->
        {os_pid, OsPid} = erlang:port_info(Port, os_pid),
        _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        catch port_close(Port),
        error({rawpeer_timeout, Acc})
    end.

%% A logger handler (Id) that sends this process {cnode_log, N, Event} for
%% every event C node N logs (log/2); remove it with logger:remove_handler/1.
-spec add_cnode_log_handler(logger:handler_id(), node()) -> ok.
add_cnode_log_handler(Id, N) ->
    ok = logger:add_handler(Id, ?MODULE, #{level => all, config => #{pid => self(), node => N}}).

%% The handler of add_cnode_log_handler/2 (logger calls it).
-spec log(logger:log_event(), logger:handler_config()) -> ok.
log(#{meta := #{cnode := N}} = Event, #{config := #{pid := Pid, node := N}}) ->
    Pid ! {cnode_log, N, Event},
    ok;
log(_Event, _Config) ->
    ok.

%% `promtool check metrics' on Text: {ExitStatus, Output}. make test
%% installs promtool (scripts/install-deps); absent, this fails.
-spec promtool_check(iodata()) -> {integer(), string()}.
promtool_check(Text) ->
    Exe = os:find_executable("promtool"),
    true = is_list(Exe),
    Dir = temp_dir("ap_promtool"),
    F = filename:join(Dir, "metrics.txt"),
    ok = file:write_file(F, Text),
    %% promtool reads the metrics on stdin.
    Out = os:cmd("'" ++ Exe ++ "' check metrics < '" ++ F ++ "' 2>&1; echo \"rc=$?\""),
    ok = file:delete(F),
    ok = file:del_dir(Dir),
    [Rc | RevLines] = lists:reverse(string:lexemes(Out, "\n")),
    {list_to_integer(string:prefix(Rc, "rc=")), string:join(lists:reverse(RevLines), "\n")}.
