%% Code that `make demo' (scripts/demo.erl) loads into its peer nodes: a
%% subscriber that reports every listing to the demo, and the work sent by
%% key from a peer. Not part of the library.
-module(demo_node).

-export([watch/3, asks/3, tells/2, split/2, hold_shutdown/1, shutdown_gate/1]).

%% A process on this node subscribed to Key; every listing goes to Driver
%% as {demo_listing, Label, NumberOfPools, PoolNodes}.
-spec watch(actor_receptionist:key(), pid(), term()) -> pid().
watch(Key, Driver, Label) ->
    Pid = spawn(fun() -> watch_loop(Key, Driver, Label) end),
    ok = actor_receptionist:subscribe(Key, Pid),
    Pid.

watch_loop(Key, Driver, Label) ->
    receive
        {listing, Key, Refs} ->
            Driver ! {demo_listing, Label, length(Refs), lists:usort([node(R) || R <- Refs])},
            watch_loop(Key, Driver, Label);
        stop ->
            ok
    end.

%% Every document as an ask by key, from Callers processes at once:
%% {Valid, Invalid, Other, Microseconds}.
-spec asks(actor_receptionist:key(), [{valid | broken, binary()}], pos_integer()) ->
          {non_neg_integer(), non_neg_integer(), [term()], non_neg_integer()}.
asks(Key, Docs, Callers) ->
    Self = self(),
    Chunks = split(Docs, Callers),
    T0 = erlang:monotonic_time(microsecond),
    Pids = [spawn_link(fun() ->
                               Self ! {done, self(), [{K, actor_pool:ask(Key, D, 10000)} || {K, D} <- C]}
                       end) || C <- Chunks],
    Results = lists:append([receive {done, P, R} -> R end || P <- Pids]),
    Us = erlang:monotonic_time(microsecond) - T0,
    Valid = length([x || {valid, {ok, ok}} <- Results]),
    Invalid = length([x || {broken, {error, {Offset, _}}} <- Results, is_integer(Offset)]),
    Other = [R || {_, R} = KR <- Results, not expected(KR)],
    {Valid, Invalid, Other, Us}.

%% Every document as a tell by key.
-spec tells(actor_receptionist:key(), [{valid | broken, binary()}]) -> ok.
tells(Key, Docs) ->
    _ = [ok = actor_pool:tell(Key, D) || {_, D} <- Docs],
    ok.

expected({valid, {ok, ok}}) -> true;
expected({broken, {error, {Offset, _}}}) when is_integer(Offset) -> true;
expected(_) -> false.

%% From now on this node's init:stop waits, once begun, until Driver lets
%% it go (or 10 s pass): Driver gets {demo_stopping, node(), Gate} and sends
%% Gate `demo_go'. The wait is kernel's shutdown_func, which the application
%% controller runs before it stops any application, so the node is still
%% connected, and after init has told global that the node is leaving. The
%% demo stops its peers so (see stop_peers/1 in demo.erl).
-spec hold_shutdown(pid()) -> ok.
hold_shutdown(Driver) ->
    persistent_term:put({?MODULE, driver}, Driver),
    application:set_env(kernel, shutdown_func, {?MODULE, shutdown_gate}).

%% kernel's shutdown_func (see hold_shutdown/1); runs in the application
%% controller.
-spec shutdown_gate(term()) -> ok.
shutdown_gate(_Reason) ->
    persistent_term:get({?MODULE, driver}) ! {demo_stopping, node(), self()},
    receive
        demo_go -> ok
    after 10000 -> ok
    end.

%% List in at most N chunks of (nearly) equal size, in order.
-spec split([T], pos_integer()) -> [[T]].
split(List, N) ->
    Size = max(1, (length(List) + N - 1) div N),
    chunk(List, Size).

chunk([], _) -> [];
chunk(List, Size) when length(List) =< Size -> [List];
chunk(List, Size) ->
    {A, B} = lists:split(Size, List),
    [A | chunk(B, Size)].
