%% @doc The lanes of the same-host data plane: one shared-memory segment
%% ({@link actor_dp}) per pool node of this host that offers rings.
%%
%% Callers ({@link actor_pool}) find the lane of a pool node with {@link
%% lane/2}: a `persistent_term' read, `{lane, Seg}' or `none'. Only when
%% there is no entry yet do they call this server, which attaches (the pool
%% node is on this host and connected, the application setting `fast_path'
%% is not `false', the NIF is loaded, the pool node answers `dp_info', and
%% {@link actor_dp:open/3} succeeds) and records the result. A `none' is
%% retried after 5 s, and at once when the node comes up again; a pool node
%% of another host stays `none'. Each reason a pool node's calls go through
%% distribution is logged once (a notice), and {@link info/0} lists every
%% lane with its counters.
%%
%% A lane ends when its pool node goes down (nodedown), when the NIF reports
%% the segment dead (`{actor_dp, Seg, down, Reason}': peer EOF, broken ring,
%% hostile bytes) or when a caller finds it closed: the segment is closed
%% with `{nodedown, Node}' (every ask waiting on it is answered at once) and
%% the entry erased. A restarted pool node gets a fresh segment.
%%
%% Pools started with `fast_path => false' are listed here too (by pid and
%% by `{Name, PoolNode}'): calls from this BEAM to them use distribution.
-module(actor_pool_dp).
-behaviour(gen_server).

%% API.
-export([start_link/0]).
-export([lane/2]).
-export([seg/1]).
-export([info/0]).
-export([counters/0]).
-export([refresh/0]).
-export([set_slow/3]).
-export([unset_slow/1]).
-export([lane_closed/2]).
-export([count/1]).

%% gen_server callbacks.
-export([init/1]).
-export([handle_call/3]).
-export([handle_cast/2]).
-export([handle_info/2]).
-export([terminate/2]).

-export_type([lane/0]).

-type lane() :: {lane, Seg :: term()} | none.

%% persistent_term keys: the lanes, the pools that asked for distribution,
%% the counters of what callers could not put in a ring.
%% ?LANES maps each pool node to its entry, `{lane, Seg}', or `{lane, Seg,
%% Slow}' while some pools asked for distribution (Slow: the ?SLOW map), so
%% that a call reads one key (each read hashes its key: two reads per tell
%% were 9% of its BEAM CPU); `none' when calls to that node use
%% distribution. One atom key for all pool nodes: an atom hashes in one
%% word, where a key of {?MODULE, lane, Node} went through
%% make_internal_hash and eq at every call. Only this server writes it.
-define(LANES, '$actor_pool_dp_lanes').
-define(SLOW, {?MODULE, slow}).
-define(COUNTERS, {?MODULE, counters}).
-define(RETRY_MS, 5000).
-define(DP_INFO_TIMEOUT, 5000).

%% counters slots
-define(C_TELL_DROPPED, 1).
-define(C_ASK_FULL, 2).
-define(C_TOO_LARGE, 3).
-define(C_CLOSED, 4).

-type counter() :: tell_dropped | ask_full | too_large | closed.

-record(st, {
    %% Node => {lane, Seg} | {none, Reason}
    lanes = #{} :: #{node() => {lane, term()} | {none, term()}},
    %% {Node, Reason} already logged
    logged = #{} :: #{{node(), term()} => true}
}).

%% ===================================================================
%% API
%% ===================================================================

%% @doc Starts the lane manager, registered as `actor_pool_dp'.
-spec start_link() -> {ok, pid()} | ignore | {error, term()}.
start_link() ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, [], []).

%% @doc The lane to use for `Dest' on `Node': `{lane, Seg}', or `none' (use
%% distribution: no rings to that pool node, or the pool asked for
%% distribution with `fast_path => false').
-spec lane(node(), pid() | {atom(), node()}) -> lane().
lane(Node, Dest) ->
    case lane_entry(Node) of
        {lane, _} = Lane ->
            Lane;
        {lane, Seg, Slow} ->
            case is_map_key(Dest, Slow) of
                true -> none;
                false -> {lane, Seg}
            end;
        none ->
            none;
        undefined ->
            case whereis(?MODULE) of
                undefined ->
                    none;
                _ ->
                    try gen_server:call(?MODULE, {lane, Node}, infinity) of
                        {lane, _} -> lane(Node, Dest);
                        none -> none
                    catch
                        exit:_ -> none
                    end
            end
    end.

%% @doc The segment of the lanes to `Node' (whatever the pool), or `none'.
%% No call: what this BEAM has at hand.
-spec seg(node()) -> {ok, Seg :: term()} | none.
seg(Node) ->
    entry_seg(lane_entry(Node)).

%% @doc Every pool node this BEAM has considered for rings: its transport
%% (`ring' or `distribution'), why distribution when it is, the segment's
%% counters ({@link actor_dp:info/1}) when it is ring; and `counters': what
%% callers could not put in a ring (`tell_dropped': tells dropped after a
%% full ring stayed full; `ask_full': asks answered `{error, overloaded}'
%% for a full ring; `too_large' and `closed': calls that went by
%% distribution for those reasons).
-spec info() -> #{lanes := [map()], counters := #{counter() => non_neg_integer()},
                  slow := [pid() | {atom(), node()}]}.
info() ->
    Lanes = case whereis(?MODULE) of
                undefined -> [];
                _ -> gen_server:call(?MODULE, info, 10000)
            end,
    #{lanes => Lanes,
      counters => counters(),
      slow => maps:keys(persistent_term:get(?SLOW, #{}))}.

%% @doc {@link info/0}'s `counters' alone (no call: for the metrics).
-spec counters() -> #{counter() => non_neg_integer()}.
counters() ->
    maps:from_list([{K, counter(K)} || K <- [tell_dropped, ask_full, too_large, closed]]).

%% @doc Applies the application setting `fast_path' now: with `false' every
%% lane is closed (calls go through distribution), with `true' pool nodes
%% without a lane are tried again on their next call. Otherwise this happens
%% within 5 s.
-spec refresh() -> ok.
refresh() ->
    gen_server:call(?MODULE, refresh, 10000).

%% @private
%% @doc Calls from this BEAM to the pool `Pid' (named `Name' on `Node')
%% use distribution (the pool was started with `fast_path => false').
-spec set_slow(pid(), atom(), node()) -> ok.
set_slow(Pid, Name, Node) ->
    call_if_running({slow, Pid, {Name, Node}}).

%% @private
%% @doc The pool (by pid or `{Name, Node}') is stopped: forget set_slow/3.
-spec unset_slow(pid() | {atom(), node()}) -> ok.
unset_slow(Key) ->
    case is_map_key(Key, persistent_term:get(?SLOW, #{})) of
        false -> ok;
        true -> call_if_running({unslow, Key})
    end.

call_if_running(Req) ->
    case whereis(?MODULE) of
        undefined -> ok;
        _ -> gen_server:call(?MODULE, Req, 10000)
    end.

%% @private
%% @doc A caller found `Seg', the lane of `Node', closed.
-spec lane_closed(node(), term()) -> ok.
lane_closed(Node, Seg) ->
    count(closed),
    gen_server:cast(?MODULE, {closed, Node, Seg}).

%% @private
-spec count(counter()) -> ok.
count(What) ->
    case persistent_term:get(?COUNTERS, undefined) of
        undefined -> ok;
        C -> counters:add(C, slot(What), 1)
    end.

counter(What) ->
    case persistent_term:get(?COUNTERS, undefined) of
        undefined -> 0;
        C -> counters:get(C, slot(What))
    end.

slot(tell_dropped) -> ?C_TELL_DROPPED;
slot(ask_full) -> ?C_ASK_FULL;
slot(too_large) -> ?C_TOO_LARGE;
slot(closed) -> ?C_CLOSED.

%% ===================================================================
%% gen_server callbacks
%% ===================================================================

%% @private
-spec init([]) -> {ok, #st{}}.
init([]) ->
    process_flag(trap_exit, true),
    %% Lanes of an earlier incarnation of this server: nobody watches them
    %% any more, so they are closed and callers attach again.
    _ = [catch actor_dp:close(Seg, restart)
         || V <- maps:values(persistent_term:get(?LANES, #{})), {ok, Seg} <- [entry_seg(V)]],
    _ = persistent_term:erase(?LANES),
    case persistent_term:get(?COUNTERS, undefined) of
        undefined -> persistent_term:put(?COUNTERS, counters:new(4, [write_concurrency]));
        _ -> ok
    end,
    ok = net_kernel:monitor_nodes(true, [{node_type, all}]),
    erlang:send_after(?RETRY_MS, self(), tick),
    {ok, #st{}}.

%% @private
-spec handle_call(term(), gen_server:from(), #st{}) -> {reply, term(), #st{}}.
handle_call({lane, Node}, _From, St) ->
    case lane_entry(Node) of
        {lane, _} = L -> {reply, L, St};
        {lane, Seg, _} -> {reply, {lane, Seg}, St};
        none -> {reply, none, St};
        undefined -> attach(Node, St)
    end;
handle_call(info, _From, #st{lanes = Lanes} = St) ->
    {reply, [lane_info(Node, L) || {Node, L} <- lists:sort(maps:to_list(Lanes))], St};
handle_call(refresh, _From, St) ->
    {reply, ok, refresh(St)};
handle_call({slow, Pid, NameNode}, _From, St) ->
    %% Each key maps to the other, so that a stop by either forgets both.
    Slow0 = persistent_term:get(?SLOW, #{}),
    put_slow(Slow0, Slow0#{Pid => NameNode, NameNode => Pid}, St),
    {reply, ok, St};
handle_call({unslow, Key}, _From, St) ->
    Slow0 = persistent_term:get(?SLOW, #{}),
    Other = maps:get(Key, Slow0, undefined),
    put_slow(Slow0, maps:without([Key, Other], Slow0), St),
    {reply, ok, St};
handle_call(_Other, _From, St) ->
    {reply, {error, badarg}, St}.

%% @private
-spec handle_cast(term(), #st{}) -> {noreply, #st{}}.
handle_cast({closed, Node, Seg}, St) ->
    {noreply, drop_lane(Node, Seg, lane_closed, St)};
handle_cast(_Other, St) ->
    {noreply, St}.

%% @private
-spec handle_info(term(), #st{}) -> {noreply, #st{}}.
handle_info({nodedown, Node, _}, St) ->
    {noreply, drop_lane(Node, any, {nodedown, Node}, St)};
handle_info({nodeup, Node, _}, #st{lanes = Lanes} = St) ->
    %% A pool node that is back (maybe a new incarnation) is tried again.
    case maps:get(Node, Lanes, undefined) of
        {none, _} -> {noreply, forget(Node, St)};
        _ -> {noreply, St}
    end;
handle_info({actor_dp, Seg, down, Reason}, St) ->
    Node = [N || {N, {lane, S}} <- maps:to_list(St#st.lanes), S =:= Seg],
    case Node of
        [N] -> {noreply, drop_lane(N, Seg, Reason, St)};
        [] -> {noreply, St}
    end;
handle_info({close, Seg, Reason}, St) ->
    _ = (catch actor_dp:close(Seg, Reason)),
    {noreply, St};
handle_info(tick, St) ->
    erlang:send_after(?RETRY_MS, self(), tick),
    {noreply, refresh(St)};
handle_info(_Other, St) ->
    {noreply, St}.

%% @private
-spec terminate(term(), #st{}) -> ok.
terminate(_Reason, #st{lanes = Lanes}) ->
    _ = [catch actor_dp:close(Seg, {nodedown, Node}) || {Node, {lane, Seg}} <- maps:to_list(Lanes)],
    _ = persistent_term:erase(?LANES),
    ok.

%% ===================================================================
%% Internals
%% ===================================================================

attach(Node, St) ->
    case open_lane(Node) of
        {ok, Seg} ->
            put_lane(Node, lane_entry(Seg, persistent_term:get(?SLOW, #{}))),
            logger:info("actor_pool: calls to pool node ~p use shared-memory rings", [Node]),
            {reply, {lane, Seg}, St#st{lanes = maps:put(Node, {lane, Seg}, St#st.lanes)}};
        {none, Why} ->
            put_lane(Node, none),
            {reply, none, log_once(Node, Why, St#st{lanes = maps:put(Node, {none, Why}, St#st.lanes)})}
    end.

%% actor_dp:loaded/0 is replaced by the NIF when it loads; its Erlang body
%% says `false', which is all dialyzer sees of it.
-dialyzer({nowarn_function, [attach/2, open_lane/1, dp_info/1]}).
open_lane(Node) ->
    Connected = lists:member(Node, nodes(connected)),
    case {same_host(Node), fast_path_env(), Connected} of
        {false, _, _} -> {none, other_host};
        {_, false, _} -> {none, {fast_path, false}};
        {_, _, false} -> {none, not_connected};
        _ ->
            case nif_loaded() of
                false ->
                    {none, nif_not_loaded};
                true ->
                    case dp_info(Node) of
                        {ok, #{socket := Sock, token := Token}} when is_binary(Sock), is_binary(Token) ->
                            Opts = #{owner => self(), node => Node},
                            case catch actor_dp:open(Sock, Token, Opts) of
                                {ok, Seg} -> {ok, Seg};
                                {error, Why} -> {none, {open_failed, Why}};
                                Other -> {none, {open_failed, Other}}
                            end;
                        {error, disabled} ->
                            {none, pool_node_disabled};
                        {error, Why} ->
                            {none, {dp_info, Why}};
                        Other ->
                            {none, {dp_info, Other}}
                    end
            end
    end.

dp_info(Node) ->
    try gen_server:call({actor_pool_node, Node}, dp_info, ?DP_INFO_TIMEOUT)
    catch
        exit:{Why, _} -> {error, Why}
    end.

nif_loaded() ->
    try actor_dp:loaded()
    catch
        error:undef -> false
    end.

fast_path_env() ->
    application:get_env(actor_pool, fast_path, true) =/= false.

same_host(Node) ->
    host(Node) =:= host(node()).

host(Node) ->
    case string:split(atom_to_list(Node), "@") of
        [_, Host] -> Host;
        _ -> ""
    end.

put_slow(Same, Same, _St) ->
    ok;
put_slow(_Old, New, #st{lanes = Lanes}) ->
    case map_size(New) of
        0 -> _ = persistent_term:erase(?SLOW);
        _ -> persistent_term:put(?SLOW, New)
    end,
    Entries = maps:fold(fun(Node, {lane, Seg}, Acc) -> Acc#{Node => lane_entry(Seg, New)};
                           (_Node, _None, Acc) -> Acc
                        end, persistent_term:get(?LANES, #{}), Lanes),
    persistent_term:put(?LANES, Entries).

%% Node's entry in ?LANES, or undefined.
lane_entry(Node) ->
    case persistent_term:get(?LANES, #{}) of
        #{Node := Entry} -> Entry;
        #{} -> undefined
    end.

%% This server only (one writer: no update is lost).
put_lane(Node, Entry) ->
    persistent_term:put(?LANES, maps:put(Node, Entry, persistent_term:get(?LANES, #{}))).

lane_entry(Seg, Slow) when map_size(Slow) =:= 0 -> {lane, Seg};
lane_entry(Seg, Slow) -> {lane, Seg, Slow}.

%% The segment of a ?LANES entry, whether or not some pools asked for
%% distribution.
entry_seg({lane, Seg}) -> {ok, Seg};
entry_seg({lane, Seg, _Slow}) -> {ok, Seg};
entry_seg(_NoneOrUndefined) -> none.

%% The env turned false closes every lane; `none' entries are retried
%% (other hosts excepted: they never get rings).
refresh(#st{lanes = Lanes} = St) ->
    St1 = case fast_path_env() of
              false ->
                  lists:foldl(fun({Node, {lane, Seg}}, Acc) ->
                                      drop_lane(Node, Seg, {fast_path, false}, Acc);
                                 (_, Acc) -> Acc
                              end, St, maps:to_list(Lanes));
              true ->
                  St
          end,
    Env = fast_path_env(),
    lists:foldl(fun({_Node, {none, other_host}}, Acc) -> Acc;
                   ({_Node, {none, {fast_path, false}}}, Acc) when not Env -> Acc;
                   ({Node, {none, _}}, Acc) -> forget(Node, Acc);
                   (_, Acc) -> Acc
                end, St1, maps:to_list(St1#st.lanes)).

forget(Node, #st{lanes = Lanes} = St) ->
    persistent_term:put(?LANES, maps:remove(Node, persistent_term:get(?LANES, #{}))),
    St#st{lanes = maps:remove(Node, Lanes)}.

%% Close the lane of Node (if it still is Seg, or any with `any') and note
%% why: callers then use distribution until a new lane is made.
drop_lane(Node, Seg, Why, #st{lanes = Lanes} = St) ->
    case maps:get(Node, Lanes, undefined) of
        {lane, S} when Seg =:= any; S =:= Seg ->
            Reason = case Why of
                         {nodedown, _} -> Why;
                         _ -> {nodedown, Node}
                     end,
            case Why of
                {fast_path, false} ->
                    %% The pool node is alive and may still hold records
                    %% callers put in: they wait for them to be read before
                    %% they switch to distribution (actor_pool), so the
                    %% segment is closed only once that had time to happen.
                    erlang:send_after(?RETRY_MS, self(), {close, S, Reason});
                _ ->
                    _ = (catch actor_dp:close(S, Reason))
            end,
            %% Info, not notice: a pool node going down is logged already
            %% (actor_cnode, net_kernel), and the next lane is made at once.
            logger:info("actor_pool: the shared-memory lane to pool node ~p is closed: ~p",
                        [Node, Why]),
            put_lane(Node, none),
            St#st{lanes = maps:put(Node, {none, Why}, Lanes)};
        _ ->
            St
    end.

log_once(_Node, not_connected, St) ->
    %% Transient: the first call connects, and the lane is made at nodeup.
    St;
log_once(Node, Why, #st{logged = Logged} = St) ->
    Key = {Node, Why},
    case maps:is_key(Key, Logged) of
        true ->
            St;
        false ->
            logger:notice("actor_pool: calls to pool node ~p use distribution, not shared-memory "
                          "rings: ~p", [Node, Why]),
            St#st{logged = maps:put(Key, true, Logged)}
    end.

lane_info(Node, {lane, Seg}) ->
    #{node => Node, transport => ring, lane => Seg,
      segment => try actor_dp:info(Seg) catch _:_ -> #{} end};
lane_info(Node, {none, Why}) ->
    #{node => Node, transport => distribution, reason => Why}.
