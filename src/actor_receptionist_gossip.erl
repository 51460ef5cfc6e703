%% @doc The receptionist across a cluster: membership, replication, removal.
%%
%% One per BEAM node (under {@link actor_receptionist_sup}, after the
%% server), registered as `actor_receptionist_gossip'.
%%
%% <h3>Membership</h3>
%% The members are the visible nodes whose BEAM runs a receptionist. On
%% `nodeup' of a visible node this process monitors
%% `{actor_receptionist_gossip, Node}' and says hello; a `noproc' at once
%% means the node runs none (it says hello itself if it starts one later).
%% A member leaves with `nodedown' or when its gossip process ends (its
%% receptionist stopped or restarted: a new incarnation).
%%
%% <h3>Replication</h3>
%% Each node is authoritative for its own registrations (the server's
%% journal) and numbers its changes: incarnation `Inc' (fresh per start of
%% this process) and version `Ver' (one per change). Changes go to every
%% member at once as a delta `{FromVer, ToVer, Ops}', coalesced while this
%% process is busy. A member that finds a gap, or a new incarnation, asks for
%% the origin's whole state and applies the difference to what it holds.
%% Every `gossip_interval_ms' each node sends every member a digest: its own
%% `{Inc, Ver}' and those of the origins it holds. That repairs lost deltas
%% and relays third-party origins: a node asks a member for an origin it
%% cannot reach itself, and drops such a relayed origin when the member that
%% relayed it no longer lists it.
%%
%% What this node holds of the others is kept by {@link
%% actor_receptionist_server} (ETS `{{Origin, Key, Ref}}', replayed into a
%% new incarnation of the C node), which this process tells what changed;
%% in the C node each ref is tagged with its origin, so a member that leaves
%% is dropped with one message (`drop_origin'), O(its refs) in C.
%%
%% <h3>Removal</h3>
%% On `nodedown' of any node (hidden ones too) this node deregisters its own
%% registrations whose refs live on that node (the server scans its
%% journal), and those changes replicate like any other. A member's own
%% registrations go with it everywhere.
-module(actor_receptionist_gossip).
-behaviour(gen_server).

-include("actor_pool_int.hrl").

-export([start_link/1]).
-export([status/0]).
-export([subscribe_when_complete/2]).

-export([init/1]).
-export([handle_call/3]).
-export([handle_cast/2]).
-export([handle_info/2]).

-export_type([status/0]).

-type status() :: #{complete := boolean(),
                    members := [node()],
                    syncing := [node()],
                    origins := #{node() => {non_neg_integer(), non_neg_integer()}},
                    incarnation := non_neg_integer(),
                    version := non_neg_integer()}.

%% Ops per delta message.
-define(MAX_DELTA, 4096).

-record(peer, {
    pid :: pid(),
    mref :: reference(),
    %% its state has been received since it (re)appeared
    synced = false :: boolean(),
    %% we asked it for its state and have no answer yet
    asked = false :: boolean()
}).

-record(st, {
    inc :: non_neg_integer(),
    ver = 0 :: non_neg_integer(),
    %% version last sent to the members
    sent = 0 :: non_neg_integer(),
    interval :: pos_integer(),
    peers = #{} :: #{node() => #peer{}},
    %% visible nodes asked whether they run a receptionist
    probing = #{} :: #{node() => reference()},
    %% origins held: {Inc, Ver, direct | ViaNode}
    origins = #{} :: #{node() => {non_neg_integer(), non_neg_integer(), direct | node()}},
    %% local changes not yet sent, newest first
    pending = [] :: [op()],
    flushing = false :: boolean(),
    %% subscriptions held until the view is complete
    waiting = [] :: [{binary(), pid()}],
    %% gossip bytes sent (external size of every message to a member)
    bytes = 0 :: non_neg_integer()
}).

-type op() :: {reg | dereg, binary(), pid()}.

%% ===================================================================
%% API
%% ===================================================================

%% @private
-spec start_link(#{gossip_interval_ms := pos_integer()}) -> {ok, pid()} | {error, term()}.
start_link(Opts) ->
    gen_server:start_link({local, ?RCPT_GOSSIP}, ?MODULE, Opts, []).

%% @doc This node's view of the cluster; see {@link actor_receptionist:status/0}.
-spec status() -> status() | {error, noproc}.
status() ->
    try gen_server:call(?RCPT_GOSSIP, status, 10000)
    catch exit:_ -> {error, noproc}
    end.

%% @private
%% @doc Subscribe `Pid' to `Id' once the view is complete (at once if it is).
-spec subscribe_when_complete(binary(), pid()) -> ok | {error, noproc}.
subscribe_when_complete(Id, Pid) ->
    case whereis(?RCPT_GOSSIP) of
        undefined -> {error, noproc};
        G -> gen_server:cast(G, {subscribe_when_complete, Id, Pid})
    end.

%% ===================================================================
%% gen_server callbacks
%% ===================================================================

-spec init(#{gossip_interval_ms := pos_integer()}) -> {ok, #st{}}.
init(#{gossip_interval_ms := Interval}) ->
    %% Whatever an earlier incarnation of this process learnt is dropped:
    %% the members send it again when we say hello.
    ok = gen_server:cast(?RCPT_SERVER, reset_remote),
    ok = net_kernel:monitor_nodes(true, [{node_type, all}]),
    St0 = #st{inc = erlang:system_time(nanosecond), interval = Interval},
    St = lists:foldl(fun probe/2, St0, nodes(visible)),
    _ = erlang:send_after(Interval, self(), tick),
    {ok, St}.

-spec handle_call(term(), gen_server:from(), #st{}) -> {reply, term(), #st{}}.
handle_call(status, _From, St) ->
    {reply, status(St), St};
handle_call(bytes, _From, St) ->
    {reply, St#st.bytes, St};
handle_call(Request, _From, St) ->
    {reply, {error, {unknown_call, Request}}, St}.

-spec handle_cast(term(), #st{}) -> {noreply, #st{}}.
handle_cast({subscribe_when_complete, Id, Pid}, St) ->
    {noreply, release(St#st{waiting = St#st.waiting ++ [{Id, Pid}]})};
handle_cast(Msg, St) ->
    logger:warning("actor_receptionist_gossip: unexpected cast ~0p", [Msg]),
    {noreply, St}.

-spec handle_info(term(), #st{}) -> {noreply, #st{}}.
handle_info({local, Op, Id, Ref}, #st{pending = P, ver = V} = St) ->
    St1 = St#st{pending = [{Op, Id, Ref} | P], ver = V + 1},
    case St1#st.flushing of
        true -> {noreply, St1};
        false -> self() ! flush, {noreply, St1#st{flushing = true}}
    end;
handle_info(flush, St) ->
    {noreply, flush(St#st{flushing = false})};
handle_info(tick, #st{interval = Interval, peers = Peers, probing = Pr} = St0) ->
    _ = erlang:send_after(Interval, self(), tick),
    %% Sends may be dropped (nosuspend): a hello or a state that never came
    %% is asked for again, once per round.
    St1 = St0#st{peers = maps:map(fun(_, P) -> P#peer{asked = false} end, Peers)},
    St = maps:fold(fun(Node, _, S) -> out({?RCPT_GOSSIP, Node}, {hello, self(), S#st.inc}, S) end,
                   St1, Pr),
    {noreply, digest(flush(St))};
handle_info({nodeup, Node, Info}, St) ->
    case proplists:get_value(node_type, Info) of
        visible -> {noreply, probe(Node, St)};
        _ -> {noreply, St}
    end;
handle_info({nodedown, Node, _Info}, St0) ->
    %% Our own registrations of processes on that node end, hidden or not.
    ok = gen_server:cast(?RCPT_SERVER, {drop_refs_on, Node}),
    St = forget_probe(Node, St0),
    {noreply, release(member_left(Node, St))};
handle_info({'DOWN', Mref, process, {?RCPT_GOSSIP, Node}, _}, #st{probing = Pr} = St) ->
    %% That node runs no receptionist (or just stopped it).
    case maps:find(Node, Pr) of
        {ok, Mref} -> {noreply, release(St#st{probing = maps:remove(Node, Pr)})};
        _ -> {noreply, St}
    end;
handle_info({'DOWN', Mref, process, Pid, _}, #st{peers = Peers} = St) ->
    Node = node(Pid),
    case maps:find(Node, Peers) of
        {ok, #peer{mref = Mref}} -> {noreply, release(member_left(Node, St))};
        _ -> {noreply, St}
    end;
handle_info({hello, Pid, _Inc}, St0) when is_pid(Pid) ->
    St1 = forget_probe(node(Pid), St0),
    St2 = peer(Pid, St1),
    St = send_state(Pid, flush(St2)),
    {noreply, ask_if_unsynced(node(Pid), St)};
handle_info({state, Pid, Inc, Ver, Regs}, St0) when is_pid(Pid) ->
    Node = node(Pid),
    St1 = peer(Pid, St0),
    St2 = replace_origin(Node, Inc, Ver, direct, Regs, St1),
    Peers = St2#st.peers,
    P = maps:get(Node, Peers),
    {noreply, release(St2#st{peers = Peers#{Node := P#peer{synced = true, asked = false}}})};
handle_info({delta, Pid, Inc, From, To, Ops}, St) when is_pid(Pid) ->
    Node = node(Pid),
    case {maps:find(Node, St#st.peers), maps:find(Node, St#st.origins)} of
        {{ok, #peer{pid = Pid}}, {ok, {Inc, From, direct}}} ->
            {noreply, apply_ops(Node, Ops, St#st{origins = (St#st.origins)#{Node := {Inc, To, direct}}})};
        {{ok, #peer{pid = Pid}}, {ok, {Inc, Ver, direct}}} when Ver >= To ->
            {noreply, St};
        {{ok, #peer{pid = Pid}}, _} ->
            %% A gap, or its state is still on the way.
            {noreply, ask(Node, St)};
        _ ->
            %% Not (yet) a member here: say hello, which gets its state.
            {noreply, ask(Node, peer(Pid, St))}
    end;
handle_info({digest, Pid, Inc, Ver, Relayed}, St0) when is_pid(Pid) ->
    Node = node(Pid),
    case maps:find(Node, St0#st.peers) of
        {ok, #peer{pid = Pid}} ->
            St1 = case maps:find(Node, St0#st.origins) of
                      {ok, {Inc, Ver, direct}} -> St0;
                      _ -> ask(Node, St0)
                  end,
            {noreply, relayed(Pid, Relayed, St1)};
        _ ->
            {noreply, ask(Node, peer(Pid, St0))}
    end;
handle_info({want_origin, Pid, Origin}, St) when is_pid(Pid) ->
    case maps:find(Origin, St#st.origins) of
        {ok, {Inc, Ver, _}} ->
            %% The server holds the rows; after every change we sent it, so
            %% they are exactly version Ver.
            ok = gen_server:cast(?RCPT_SERVER, {origin_state, Pid, self(), Origin, Inc, Ver}),
            {noreply, St};
        error ->
            {noreply, St}
    end;
handle_info({origin_state, Pid, Origin, Inc, Ver, Regs}, St) when is_pid(Pid) ->
    Via = node(Pid),
    Mine = Origin =:= node() orelse maps:is_key(Origin, St#st.peers),
    Newer = case maps:find(Origin, St#st.origins) of
                {ok, {I, V, _}} -> {Inc, Ver} > {I, V};
                error -> true
            end,
    case not Mine andalso Newer andalso maps:is_key(Via, St#st.peers) of
        true -> {noreply, replace_origin(Origin, Inc, Ver, Via, Regs, St)};
        false -> {noreply, St}
    end;
handle_info(Msg, St) ->
    logger:warning("actor_receptionist_gossip: unexpected message ~0p", [Msg]),
    {noreply, St}.

%% ===================================================================
%% Members
%% ===================================================================

probe(Node, #st{probing = Pr, peers = Peers} = St) ->
    case maps:is_key(Node, Pr) orelse maps:is_key(Node, Peers) of
        true ->
            St;
        false ->
            Mref = erlang:monitor(process, {?RCPT_GOSSIP, Node}),
            St1 = out({?RCPT_GOSSIP, Node}, {hello, self(), St#st.inc}, St),
            St1#st{probing = Pr#{Node => Mref}}
    end.

forget_probe(Node, #st{probing = Pr} = St) ->
    case maps:take(Node, Pr) of
        {Mref, Pr1} -> erlang:demonitor(Mref, [flush]), St#st{probing = Pr1};
        error -> St
    end.

%% Pid is the gossip process of a member: record (and monitor) it.
peer(Pid, #st{peers = Peers} = St) ->
    Node = node(Pid),
    case maps:find(Node, Peers) of
        {ok, #peer{pid = Pid}} ->
            St;
        {ok, #peer{mref = Old}} ->
            %% A new incarnation: the old one's refs go when its state comes.
            erlang:demonitor(Old, [flush]),
            St#st{peers = Peers#{Node := #peer{pid = Pid, mref = erlang:monitor(process, Pid)}}};
        error ->
            St#st{peers = Peers#{Node => #peer{pid = Pid, mref = erlang:monitor(process, Pid)}}}
    end.

ask_if_unsynced(Node, St) ->
    case maps:get(Node, St#st.peers) of
        #peer{synced = true} -> St;
        _ -> ask(Node, St)
    end.

%% Ask a member for its whole state (a hello), once until it answers.
ask(Node, #st{peers = Peers} = St) ->
    case maps:find(Node, Peers) of
        {ok, #peer{asked = true}} ->
            St;
        {ok, #peer{pid = Pid} = P} ->
            St1 = out(Pid, {hello, self(), St#st.inc}, St),
            St1#st{peers = Peers#{Node := P#peer{asked = true}}};
        error ->
            St
    end.

member_left(Node, #st{peers = Peers} = St0) ->
    St1 = case maps:take(Node, Peers) of
              {#peer{mref = Mref}, Peers1} ->
                  erlang:demonitor(Mref, [flush]),
                  St0#st{peers = Peers1};
              error ->
                  St0
          end,
    %% Its registrations, and the origins we only knew through it.
    Gone = [O || {O, {_, _, Via}} <- maps:to_list(St1#st.origins),
                 O =:= Node orelse Via =:= Node],
    lists:foldl(fun drop_origin/2, St1, Gone).

%% ===================================================================
%% Origins
%% ===================================================================

drop_origin(Origin, #st{origins = Os} = St) ->
    ok = gen_server:cast(?RCPT_SERVER, {drop_origin, Origin}),
    St#st{origins = maps:remove(Origin, Os)}.

%% What we hold of Origin becomes Regs; the server applies the difference,
%% so subscribers see one listing per changed ref and none for a ref that
%% stays.
replace_origin(Origin, Inc, Ver, Via, Regs, #st{origins = Os} = St) ->
    ok = gen_server:cast(?RCPT_SERVER, {replace_origin, Origin, Regs}),
    St#st{origins = Os#{Origin => {Inc, Ver, Via}}}.

apply_ops(Origin, Ops, St) ->
    ok = gen_server:cast(?RCPT_SERVER, {remote, Origin, Ops}),
    St.

%% The third-party origins a member holds: fetch those newer than ours
%% (unless we reach them ourselves), and drop those we got through it that
%% it no longer lists.
relayed(Pid, Relayed, #st{origins = Os, peers = Peers} = St0) ->
    Via = node(Pid),
    Listed = maps:from_list([{O, {I, V}} || {O, I, V} <- Relayed, is_atom(O)]),
    St1 = maps:fold(
            fun(O, {I, V}, St) when O =/= node() ->
                    Ours = maps:find(O, Os),
                    Direct = maps:is_key(O, Peers),
                    case Ours of
                        _ when Direct -> St;
                        {ok, {OI, OV, _}} when {OI, OV} >= {I, V} -> St;
                        _ -> out(Pid, {want_origin, self(), O}, St)
                    end;
               (_, _, St) ->
                    St
            end, St0, Listed),
    Stale = [O || {O, {_, _, V}} <- maps:to_list(St1#st.origins), V =:= Via,
                  not maps:is_key(O, Listed)],
    lists:foldl(fun drop_origin/2, St1, Stale).

%% ===================================================================
%% Sending
%% ===================================================================

flush(#st{pending = []} = St) ->
    St;
flush(#st{pending = P, sent = Sent, ver = Ver, inc = Inc, peers = Peers} = St) ->
    Ops = lists:reverse(P),
    St1 = send_deltas(Ops, Sent, Inc, Peers, St),
    St1#st{pending = [], sent = Ver}.

send_deltas([], _From, _Inc, _Peers, St) ->
    St;
send_deltas(Ops, From, Inc, Peers, St) ->
    {Now, Rest} = split(Ops, ?MAX_DELTA),
    To = From + length(Now),
    Msg = {delta, self(), Inc, From, To, Now},
    St1 = maps:fold(fun(_, #peer{pid = Pid}, S) -> out(Pid, Msg, S) end, St, Peers),
    send_deltas(Rest, To, Inc, Peers, St1).

split(L, N) when length(L) =< N -> {L, []};
split(L, N) -> lists:split(N, L).

send_state(Pid, #st{inc = Inc, ver = Ver} = St) ->
    Regs = ets:tab2list(?RCPT_REGS),
    out(Pid, {state, self(), Inc, Ver, Regs}, St).

digest(#st{peers = Peers, inc = Inc, ver = Ver, origins = Os} = St) ->
    maps:fold(fun(Node, #peer{pid = Pid}, S) ->
                      Relayed = [{O, I, V} || {O, {I, V, _}} <- maps:to_list(Os), O =/= Node],
                      out(Pid, {digest, self(), Inc, Ver, Relayed}, S)
              end, St, Peers).

%% Never block on a busy or reconnecting distribution channel: what is lost
%% is repaired by the next digest.
out(Dest, Msg, #st{bytes = B} = St) ->
    _ = erlang:send(Dest, Msg, [noconnect, nosuspend]),
    St#st{bytes = B + erlang:external_size(Msg)}.

%% ===================================================================
%% Completeness
%% ===================================================================

complete(#st{probing = Pr, peers = Peers}) ->
    map_size(Pr) =:= 0 andalso
        lists:all(fun(#peer{synced = S}) -> S end, maps:values(Peers)).

status(#st{peers = Peers, probing = Pr, origins = Os, inc = Inc, ver = Ver} = St) ->
    #{complete => complete(St),
      members => lists:sort(maps:keys(Peers)),
      syncing => lists:sort(maps:keys(Pr) ++ [N || {N, #peer{synced = false}} <- maps:to_list(Peers)]),
      origins => maps:map(fun(_, {I, V, _}) -> {I, V} end, Os),
      incarnation => Inc,
      version => Ver}.

%% Subscriptions held for a complete view go out once it is.
release(#st{waiting = []} = St) ->
    St;
release(#st{waiting = W} = St) ->
    case complete(St) of
        true ->
            _ = [gen_server:cast(?RCPT_SERVER, {subscribe, Id, Pid}) || {Id, Pid} <- W],
            St#st{waiting = []};
        false ->
            St
    end.
