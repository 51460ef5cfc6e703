%% @doc The receptionist across a cluster: membership, replication, removal.
%%
%% Not a process: the state and the rules that {@link
%% actor_receptionist_server} runs inside its own process, so that a local
%% change, its version and the delta that carries it are one step (no hop,
%% no window where the journal and the version disagree), and a change
%% learnt from a member goes to the C node without a hop either. Members
%% talk to each other's `actor_receptionist_server'. The core calls no
%% other module of this application: the caller passes in what it needs
%% (env(): the journal, this node's own C nodes) and applies the effects.
%%
%% <h3>Membership</h3>
%% The members are the visible nodes whose BEAM runs a receptionist. On
%% `nodeup' of a visible node the server monitors
%% `{actor_receptionist_server, Node}' and says hello; a `noproc' at once
%% means the node runs none (it says hello itself if it starts one later).
%% A member leaves with `nodedown' or when its server ends (its receptionist
%% stopped or restarted: a new incarnation).
%%
%% <h3>Replication</h3>
%% Each node is authoritative for its own registrations (the server's
%% journal) and numbers its changes: incarnation `Inc' (fresh per start of
%% the server) and version `Ver' (one per change). Changes go to every
%% member as a delta `{FromVer, ToVer, Ops}', one per burst. A member that
%% finds a gap, or a new incarnation, asks the origin for its whole state
%% (read from the journal in the same step as its version) and applies the
%% difference to what it holds. Every `gossip_interval_ms' each node sends
%% every member a digest: its own `{Inc, Ver}' and the origins it reaches
%% directly. That repairs lost deltas and relays origins one hop: a node
%% that cannot reach an origin asks a member that reaches it directly, and
%% drops it when no member it hears from lists it as direct any more
%% (split horizon: an origin is never listed back to the node it came
%% through, and a relayed origin is never relayed again, so two nodes cannot
%% keep a dead origin alive between them).
%%
%% <h3>Hidden nodes: followers</h3>
%% A BEAM started with `-hidden' is no member. Its receptionist follows
%% the nodes it connects to instead: it says `follow' rather than hello, and
%% a member answers with its state and then sends it its deltas and digests,
%% without asking for a state back or counting it for completeness. Other
%% members' registrations reach a follower as relayed origins. A follower's
%% own registrations are made on a member it follows (see
%% actor_receptionist_server), so they live as long as its connection to
%% that member. A node that never answers a probe (a C node, a BEAM without
%% the application) stops being waited for after three gossip rounds.
%%
%% <h3>Removal</h3>
%% On `nodedown' of any node (hidden ones too) the server deregisters its
%% own registrations whose refs live on that node, and those changes
%% replicate like any other. A member's own registrations go with it
%% everywhere (`drop_origin').
-module(actor_receptionist_gossip).

-include("actor_pool_int.hrl").
-include("actor_receptionist_int.hrl").

-export([new/2]).
-export([local/4]).
-export([flush/1]).
-export([handle/3]).
-export([hold/3]).
-export([cancel/3]).
-export([status/1]).
-export([bytes/1]).
-export([sent/2]).
-export([follows/1]).
-export([hidden/1]).

-export_type([state/0, effect/0, status/0, env/0]).

-type status() :: #{complete := boolean(),
                    members := [node()],
                    syncing := [node()],
                    origins := #{node() => {non_neg_integer(), non_neg_integer()}},
                    incarnation := non_neg_integer(),
                    version := non_neg_integer(),
                    gossip := #{sent | sent_bytes | received | received_bytes | full_syncs
                                | member_drops => non_neg_integer()}}.

-type op() :: {reg | dereg, binary(), pid()}.

-type effect() :: {remote, node(), [op()]}
                | {replace_origin, node(), [{binary(), pid()}]}
                | {drop_origin, node()}
                | {origin_state, pid(), node(), non_neg_integer(), non_neg_integer()}
                | {drop_refs_on, node()}
                | {subscribe, binary(), pid()}
                | {synced_with, node()}.
%% What the server must do with its tables and its C node, in order.

-type env() :: #{journal := fun(() -> [{binary(), pid()}]),
                 cnodes := [node()]}.
%% What the caller knows: its journal, read only when a member asks for our
%% state (it costs O(registrations)) and in the same step as our version;
%% and the C nodes of this BEAM, which connect to it hidden and are never
%% probed.

%% Ops per delta message.
-define(MAX_DELTA, 4096).

-record(peer, {
    pid :: pid(),
    mref :: reference(),
    %% its state has been received since it (re)appeared
    synced = false :: boolean(),
    %% we asked it for its state this round and have no answer yet
    asked = false :: boolean(),
    %% the origins it reached directly, as of its last digest
    direct = #{} :: #{node() => {non_neg_integer(), non_neg_integer()}}
}).

-record(g, {
    inc :: non_neg_integer(),
    ver = 0 :: non_neg_integer(),
    %% version last sent to the members
    sent = 0 :: non_neg_integer(),
    interval :: pos_integer(),
    peers = #{} :: #{node() => #peer{}},
    %% nodes asked whether they run a receptionist: the monitor, and the
    %% gossip rounds left before it stops being waited for
    probing = #{} :: #{node() => {reference(), non_neg_integer()}},
    %% this node is hidden: it follows the nodes it connects to
    hidden = false :: boolean(),
    %% (on a member) the hidden nodes that follow us
    followers = #{} :: #{node() => #peer{}},
    %% (on a follower) connected nodes that answered no probe: rounds until
    %% they are probed again (a member's receptionist may start later)
    nonmembers = #{} :: #{node() => non_neg_integer()},
    %% origins held: {Inc, Ver, direct | ViaNode}
    origins = #{} :: #{node() => {non_neg_integer(), non_neg_integer(), direct | node()}},
    %% local changes not yet sent, newest first
    pending = [] :: [op()],
    %% subscriptions held until the view is complete, oldest first
    waiting = [] :: [{binary(), pid()}],
    %% what the caller of handle/2 must do, newest first
    effects = [] :: [effect()],
    %% gossip bytes handed to distribution (external size)
    bytes = 0 :: non_neg_integer(),
    %% counters for status/1's `gossip' (the metrics): messages handed to
    %% distribution, messages and bytes taken in, whole states taken in,
    %% members that left
    msgs_sent = 0 :: non_neg_integer(),
    received = 0 :: non_neg_integer(),
    received_bytes = 0 :: non_neg_integer(),
    full_syncs = 0 :: non_neg_integer(),
    member_drops = 0 :: non_neg_integer()
}).

-opaque state() :: #g{}.

%% ===================================================================
%% API (called by actor_receptionist_server, in its process)
%% ===================================================================

%% @private
%% @doc A new incarnation: subscribes the calling process to node events,
%% says hello to every visible node (a hidden node: to every connected one
%% but CNodes, its own C nodes), starts the digest timer.
-spec new(pos_integer(), [node()]) -> state().
new(Interval, CNodes) ->
    ok = net_kernel:monitor_nodes(true, [{node_type, all}]),
    Hidden = init:get_argument(hidden) =/= error,
    G0 = #g{inc = incarnation(), interval = Interval, hidden = Hidden},
    G = lists:foldl(fun probe/2, G0, candidates(CNodes, G0)),
    _ = erlang:send_after(Interval, self(), {?MODULE, tick}),
    G.

%% @private
%% @doc One local change, applied to the journal in this same step; it goes
%% out with the next flush/1.
-spec local(reg | dereg, binary(), pid(), state()) -> state().
local(Op, Id, Ref, #g{pending = P, ver = V} = G) ->
    G#g{pending = [{Op, Id, Ref} | P], ver = V + 1}.

%% @private
%% @doc Sends the pending changes to every member, as one delta (or a few).
-spec flush(state()) -> state().
flush(#g{pending = []} = G) ->
    G;
flush(#g{pending = P, sent = Sent, ver = Ver, inc = Inc, peers = Peers, followers = Fs,
         hidden = Hidden} = G) ->
    %% A follower's registrations are made on a member (they reach it as
    %% that member's); what it records itself stays its own.
    To = case Hidden of
             true -> Fs;
             false -> maps:merge(Fs, Peers)
         end,
    G1 = send_deltas(lists:reverse(P), Sent, Inc, To, G),
    G1#g{pending = [], sent = Ver}.

%% @private
%% @doc A message for the cluster half: `{ok, State, Effects}' (effects in
%% order), or `ignore' for a message that is not one.
-spec handle(term(), env(), state()) -> {ok, state(), [effect()]} | ignore.
handle(Msg, Env, G00) ->
    G0 = count_in(Msg, G00),
    case handle1(Msg, Env, G0) of
        ignore ->
            ignore;
        #g{} = G1 ->
            #g{effects = E} = G = release(G1),
            {ok, G#g{effects = []}, lists:reverse(E)}
    end.

%% @private
%% @doc Hold a subscription until the view is complete: `{Now, State}' where
%% Now is true when it is complete already (subscribe at once).
-spec hold(binary(), pid(), state()) -> {boolean(), state()}.
hold(Id, Pid, G) ->
    case complete(G) of
        true -> {true, G};
        false -> {false, G#g{waiting = G#g.waiting ++ [{Id, Pid}]}}
    end.

%% @private
%% @doc An unsubscribe also cancels a held subscription.
-spec cancel(binary(), pid(), state()) -> state().
cancel(Id, Pid, #g{waiting = W} = G) ->
    G#g{waiting = [E || E <- W, E =/= {Id, Pid}]}.

%% @private
-spec status(state()) -> status().
status(#g{peers = Peers, probing = Pr, origins = Os, inc = Inc, ver = Ver} = G) ->
    #{gossip => #{sent => G#g.msgs_sent, sent_bytes => G#g.bytes, received => G#g.received,
                  received_bytes => G#g.received_bytes, full_syncs => G#g.full_syncs,
                  member_drops => G#g.member_drops},
      complete => complete(G),
      members => lists:sort(maps:keys(Peers)),
      syncing => lists:usort(maps:keys(Pr) ++
                                 [N || {N, #peer{synced = false}} <- maps:to_list(Peers)]),
      origins => maps:map(fun(_, {I, V, _}) -> {I, V} end, Os),
      incarnation => Inc,
      version => Ver}.

%% @private
%% @doc On a hidden node: the members it follows, synced ones first;
%% `none' on a member (it keeps its registrations itself).
-spec follows(state()) -> [node()] | none.
follows(#g{hidden = false}) ->
    none;
follows(#g{peers = Peers}) ->
    [N || {N, #peer{synced = true}} <- maps:to_list(Peers)] ++
        [N || {N, #peer{synced = false}} <- maps:to_list(Peers)].

%% @private
-spec hidden(state()) -> boolean().
hidden(#g{hidden = H}) ->
    H.

%% @private
-spec bytes(state()) -> non_neg_integer().
bytes(#g{bytes = B}) ->
    B.

%% ===================================================================
%% Messages
%% ===================================================================

handle1({?MODULE, tick}, _Env, #g{interval = Interval, peers = Peers, probing = Pr0} = G0) ->
    _ = erlang:send_after(Interval, self(), {?MODULE, tick}),
    %% Sends may be dropped (nosuspend): a hello or a state that never came
    %% is asked for again, once per round. A probe unanswered for three
    %% rounds (no DOWN either: a C node) is not waited for any more.
    Expired = [N || {N, {_, 0}} <- maps:to_list(Pr0)],
    Pr = maps:filtermap(fun(_, {Mref, 0}) -> erlang:demonitor(Mref, [flush]), false;
                           (_, {Mref, N}) -> {true, {Mref, N - 1}}
                        end, Pr0),
    G1 = reprobe(lists:foldl(fun nonmember/2,
                             G0#g{peers = maps:map(fun(_, P) -> P#peer{asked = false} end, Peers),
                                  probing = Pr},
                             Expired)),
    G = maps:fold(fun(Node, _, S) -> out({?RCPT_SERVER, Node}, hello(S), S) end, G1, Pr),
    digest(flush(G));
handle1({nodeup, Node, Info}, #{cnodes := CNodes}, #g{hidden = Hidden} = G) when is_list(Info) ->
    case proplists:get_value(node_type, Info) of
        visible -> probe(Node, G);
        hidden when Hidden -> case lists:member(Node, CNodes) of
                                  true -> G;
                                  false -> probe(Node, G)
                              end;
        _ -> G
    end;
handle1({nodedown, Node, Info}, _Env, #g{followers = Fs, nonmembers = NMs} = G0)
  when is_list(Info) ->
    %% Our own registrations of processes on that node end, hidden or not.
    G = effect({drop_refs_on, Node}, forget_probe(Node, G0#g{followers = maps:remove(Node, Fs),
                                                           nonmembers = maps:remove(Node, NMs)})),
    member_left(Node, G);
handle1({'DOWN', Mref, process, {?RCPT_SERVER, Node}, _}, _Env, #g{probing = Pr} = G) ->
    %% That node runs no receptionist (or just stopped it).
    case maps:find(Node, Pr) of
        {ok, {Mref, _}} -> nonmember(Node, G#g{probing = maps:remove(Node, Pr)});
        _ -> G
    end;
handle1({'DOWN', Mref, process, Pid, _}, _Env, #g{peers = Peers, followers = Fs} = G)
  when is_pid(Pid) ->
    Node = node(Pid),
    case {maps:find(Node, Peers), maps:find(Node, Fs)} of
        {{ok, #peer{mref = Mref}}, _} ->
            %% Its receptionist ended; a new one is probed next round.
            G1 = member_left(Node, G),
            case G1#g.hidden andalso lists:member(Node, nodes(connected)) of
                true -> G1#g{nonmembers = (G1#g.nonmembers)#{Node => 1}};
                false -> G1
            end;
        {_, {ok, #peer{mref = Mref}}} -> G#g{followers = maps:remove(Node, Fs)};
        _ -> ignore
    end;
handle1({ap_rcpt_follow, _Pid, _Inc}, _Env, #g{hidden = true} = G) ->
    %% Only members are followed: two hidden nodes never follow each other.
    G;
handle1({ap_rcpt_follow, Pid, _Inc}, #{journal := Journal}, #g{followers = Fs} = G0)
  when is_pid(Pid) ->
    %% A hidden node follows us: our state now, then our deltas and digests.
    Node = node(Pid),
    G1 = case maps:find(Node, Fs) of
             {ok, #peer{pid = Pid}} ->
                 G0;
             Old ->
                 _ = [erlang:demonitor(M, [flush]) || {ok, #peer{mref = M}} <- [Old]],
                 G0#g{followers = Fs#{Node => #peer{pid = Pid, mref = erlang:monitor(process, Pid)}}}
         end,
    send_state(Pid, Journal, flush(G1));
handle1({ap_rcpt_hello, Pid, _Inc}, #{journal := Journal}, G0) when is_pid(Pid) ->
    G1 = peer(Pid, forget_probe(node(Pid), G0)),
    %% Flushed first: the state is then exactly version Ver and every
    %% delta sent later starts there.
    G = send_state(Pid, Journal, flush(G1)),
    ask_if_unsynced(node(Pid), G);
handle1({ap_rcpt_state, Pid, Inc, Ver, Regs}, _Env, G0) when is_pid(Pid), is_list(Regs) ->
    Node = node(Pid),
    %% A member answers a follower's probe with its state, not a hello.
    G1 = peer(Pid, forget_probe(Node, G0)),
    G2 = replace_origin(Node, Inc, Ver, direct, Regs, G1),
    Peers = G2#g.peers,
    P = maps:get(Node, Peers),
    G3 = G2#g{peers = Peers#{Node := P#peer{synced = true, asked = false}}},
    %% A follower's registrations are held by the members it follows: this
    %% one gets them all (again) now.
    case G3#g.hidden of
        true -> effect({synced_with, Node}, G3);
        false -> G3
    end;
handle1({ap_rcpt_delta, Pid, Inc, From, To, Ops}, _Env, G) when is_pid(Pid), is_list(Ops) ->
    Node = node(Pid),
    case {maps:find(Node, G#g.peers), maps:find(Node, G#g.origins)} of
        {{ok, #peer{pid = Pid}}, {ok, {Inc, From, direct}}} ->
            effect({remote, Node, Ops}, G#g{origins = (G#g.origins)#{Node := {Inc, To, direct}}});
        {{ok, #peer{pid = Pid}}, {ok, {Inc, Ver, direct}}} when Ver >= To ->
            G;
        {{ok, #peer{pid = Pid}}, _} ->
            %% A gap, or its state is still on the way.
            ask(Node, G);
        _ ->
            %% Not (yet) a member here: a hello gets its state.
            ask(Node, peer(Pid, G))
    end;
handle1({ap_rcpt_digest, Pid, Inc, Ver, Direct}, _Env, G0) when is_pid(Pid), is_list(Direct) ->
    Node = node(Pid),
    case maps:find(Node, G0#g.peers) of
        {ok, #peer{pid = Pid} = P} ->
            Listed = maps:from_list([{O, {I, V}} || {O, I, V} <- Direct, is_atom(O)]),
            G1 = G0#g{peers = (G0#g.peers)#{Node := P#peer{direct = Listed}}},
            G2 = case maps:find(Node, G1#g.origins) of
                     {ok, {Inc, Ver, direct}} -> G1;
                     _ -> ask(Node, G1)
                 end,
            relayed(Pid, Listed, G2);
        _ ->
            ask(Node, peer(Pid, G0))
    end;
handle1({ap_rcpt_want_origin, Pid, Origin}, _Env, G) when is_pid(Pid) ->
    %% Only origins we reach ourselves are relayed (one hop).
    case maps:find(Origin, G#g.origins) of
        {ok, {Inc, Ver, direct}} -> effect({origin_state, Pid, Origin, Inc, Ver}, G);
        _ -> G
    end;
handle1({ap_rcpt_origin_state, Pid, Origin, Inc, Ver, Regs}, _Env, G)
  when is_pid(Pid), is_list(Regs) ->
    Via = node(Pid),
    Mine = Origin =:= node() orelse maps:is_key(Origin, G#g.peers),
    Wanted = case maps:find(Origin, G#g.origins) of
                 {ok, {I, V, _}} -> {I, V} =/= {Inc, Ver};
                 error -> true
             end,
    case not Mine andalso Wanted andalso maps:is_key(Via, G#g.peers) of
        true -> replace_origin(Origin, Inc, Ver, Via, Regs, G);
        false -> G
    end;
handle1(_, _Env, _G) ->
    ignore.

%% ===================================================================
%% Members
%% ===================================================================

probe(Node, #g{probing = Pr, peers = Peers} = G) ->
    case maps:is_key(Node, Pr) orelse maps:is_key(Node, Peers) of
        true ->
            G;
        false ->
            Mref = erlang:monitor(process, {?RCPT_SERVER, Node}),
            G1 = out({?RCPT_SERVER, Node}, hello(G), G),
            G1#g{probing = Pr#{Node => {Mref, 3}}}
    end.

%% (follower) A connected node that answered no probe is probed again
%% after ten rounds; a member's is not waited for meanwhile.
nonmember(Node, #g{hidden = true, nonmembers = NMs} = G) ->
    G#g{nonmembers = NMs#{Node => 10}};
nonmember(_Node, G) ->
    G.

reprobe(#g{hidden = false} = G) ->
    G;
reprobe(#g{nonmembers = NMs} = G0) ->
    {Due, Wait} = lists:partition(fun({_, N}) -> N =< 0 end, maps:to_list(NMs)),
    G = G0#g{nonmembers = maps:from_list([{Node, N - 1} || {Node, N} <- Wait])},
    Connected = nodes(connected),
    lists:foldl(fun({Node, _}, S) ->
                        case lists:member(Node, Connected) of
                            true -> probe(Node, S);
                            false -> S
                        end
                end, G, Due).

%% A follower asks to follow; a member says hello.
hello(#g{inc = Inc, hidden = true}) ->
    {ap_rcpt_follow, self(), Inc};
hello(#g{inc = Inc}) ->
    {ap_rcpt_hello, self(), Inc}.

%% The nodes to probe at start: visible ones; a hidden node has only hidden
%% connections, its own C nodes aside.
candidates(_CNodes, #g{hidden = false}) ->
    nodes(visible);
candidates(CNodes, #g{hidden = true}) ->
    nodes(connected) -- CNodes.

forget_probe(Node, #g{probing = Pr} = G) ->
    case maps:take(Node, Pr) of
        {{Mref, _}, Pr1} -> erlang:demonitor(Mref, [flush]), G#g{probing = Pr1};
        error -> G
    end.

%% Pid is the receptionist server of a member: record (and monitor) it.
peer(Pid, #g{peers = Peers} = G) ->
    Node = node(Pid),
    New = fun() -> #peer{pid = Pid, mref = erlang:monitor(process, Pid)} end,
    case maps:find(Node, Peers) of
        {ok, #peer{pid = Pid}} ->
            G;
        {ok, #peer{mref = Old}} ->
            %% A new incarnation: the old one's refs go when its state comes.
            erlang:demonitor(Old, [flush]),
            G#g{peers = Peers#{Node := New()}};
        error ->
            G#g{peers = Peers#{Node => New()}}
    end.

ask_if_unsynced(Node, G) ->
    case maps:get(Node, G#g.peers) of
        #peer{synced = true} -> G;
        _ -> ask(Node, G)
    end.

%% Ask a member for its whole state (a hello), once a round.
ask(Node, #g{peers = Peers} = G) ->
    case maps:find(Node, Peers) of
        {ok, #peer{asked = true}} ->
            G;
        {ok, #peer{pid = Pid} = P} ->
            G1 = out(Pid, hello(G), G),
            G1#g{peers = Peers#{Node := P#peer{asked = true}}};
        error ->
            G
    end.

member_left(Node, #g{peers = Peers} = G0) ->
    G1 = case maps:take(Node, Peers) of
             {#peer{mref = Mref}, Peers1} ->
                 erlang:demonitor(Mref, [flush]),
                 G0#g{peers = Peers1, member_drops = G0#g.member_drops + 1};
             error ->
                 G0
         end,
    %% Its registrations; the origins we held through it move to another
    %% member that reaches them, or go.
    Held = [O || {O, {_, _, Via}} <- maps:to_list(G1#g.origins), O =:= Node orelse Via =:= Node],
    lists:foldl(fun(O, G) when O =:= Node -> drop_origin(O, G);
                   (O, G) -> reroute(O, G)
                end, G1, Held).

%% ===================================================================
%% Origins
%% ===================================================================

drop_origin(Origin, #g{origins = Os} = G) ->
    effect({drop_origin, Origin}, G#g{origins = maps:remove(Origin, Os)}).

replace_origin(Origin, Inc, Ver, Via, Regs, #g{origins = Os} = G) ->
    effect({replace_origin, Origin, Regs}, G#g{origins = Os#{Origin => {Inc, Ver, Via}}}).

%% The origins a member reaches directly: fetch those we do not reach
%% ourselves and hold at another version (through this member, or not at
%% all); and a relayed origin its relay no longer lists moves to another
%% member that lists it, or goes.
relayed(Pid, Listed, #g{peers = Peers} = G0) ->
    Via = node(Pid),
    G1 = maps:fold(
           fun(O, _, G) when O =:= node() -> G;
              (O, {I, V}, #g{origins = Os} = G) ->
                   case maps:find(O, Os) of
                       _ when is_map_key(O, Peers) -> G;
                       {ok, {_, _, direct}} -> G;
                       {ok, {I, V, _}} -> G;
                       {ok, {_, _, Via}} -> out(Pid, {ap_rcpt_want_origin, self(), O}, G);
                       {ok, {_, _, _Other}} -> G;
                       error -> out(Pid, {ap_rcpt_want_origin, self(), O}, G)
                   end
           end, G0, Listed),
    Stale = [O || {O, {_, _, V}} <- maps:to_list(G1#g.origins), V =:= Via,
                  not maps:is_key(O, Listed)],
    lists:foldl(fun reroute/2, G1, Stale).

%% Origin was relayed by a member that no longer does: fetch it from another
%% member that lists it as direct (the diff then keeps what stays), or drop
%% it.
reroute(Origin, #g{peers = Peers} = G) ->
    case [P || P = #peer{direct = D} <- maps:values(Peers), maps:is_key(Origin, D)] of
        [#peer{pid = Pid} | _] ->
            Os = G#g.origins,
            {I, V, _} = maps:get(Origin, Os),
            G1 = G#g{origins = Os#{Origin := {I, V, node(Pid)}}},
            out(Pid, {ap_rcpt_want_origin, self(), Origin}, G1);
        [] ->
            drop_origin(Origin, G)
    end.

effect(E, #g{effects = Es} = G) ->
    G#g{effects = [E | Es]}.

%% ===================================================================
%% Sending
%% ===================================================================

send_deltas([], _From, _Inc, _Peers, G) ->
    G;
send_deltas(Ops, From, Inc, Peers, G) ->
    {Now, Rest} = split(Ops, ?MAX_DELTA),
    To = From + length(Now),
    Msg = {ap_rcpt_delta, self(), Inc, From, To, Now},
    G1 = maps:fold(fun(_, #peer{pid = Pid}, S) -> out(Pid, Msg, S) end, G, Peers),
    send_deltas(Rest, To, Inc, Peers, G1).

split(L, N) when length(L) =< N -> {L, []};
split(L, N) -> lists:split(N, L).

%% The journal is written in the same process, so this is version Ver.
send_state(Pid, Journal, #g{inc = Inc, ver = Ver} = G) ->
    out(Pid, {ap_rcpt_state, self(), Inc, Ver, Journal()}, G).

%% Our own version, and the origins we reach directly, except the receiver.
digest(#g{hidden = true} = G) ->
    %% A follower is no member: it asks (follow) when it finds a gap.
    G;
digest(#g{peers = Peers, followers = Fs, inc = Inc, ver = Ver, origins = Os} = G) ->
    Direct = [{O, I, V} || {O, {I, V, direct}} <- maps:to_list(Os)],
    maps:fold(fun(Node, #peer{pid = Pid}, S) ->
                      out(Pid, {ap_rcpt_digest, self(), Inc, Ver,
                                [D || {O, _, _} = D <- Direct, O =/= Node]}, S)
              end, G, maps:merge(Fs, Peers)).

%% Never block on a busy or reconnecting distribution channel: what is lost
%% is repaired by the next digest.
out(Dest, Msg, G) ->
    case erlang:send(Dest, Msg, [noconnect, nosuspend]) of
        ok -> sent(Msg, G);
        _ -> G
    end.

%% @private
%% @doc Count Msg as gossip sent (the server sends origin states itself).
-spec sent(term(), state()) -> state().
sent(Msg, #g{bytes = B, msgs_sent = N} = G) ->
    G#g{bytes = B + erlang:external_size(Msg), msgs_sent = N + 1}.

%% Gossip taken in: the other receptionists' messages (ap_rcpt_*); whole
%% states (a member's, or an origin's through a relay) also as full syncs.
count_in(Msg, #g{received = N, received_bytes = B, full_syncs = F} = G)
  when is_tuple(Msg), tuple_size(Msg) >= 2 ->
    case element(1, Msg) of
        Tag when Tag =:= ap_rcpt_state; Tag =:= ap_rcpt_origin_state ->
            G#g{received = N + 1, received_bytes = B + erlang:external_size(Msg), full_syncs = F + 1};
        Tag when Tag =:= ap_rcpt_hello; Tag =:= ap_rcpt_follow; Tag =:= ap_rcpt_delta;
                 Tag =:= ap_rcpt_digest; Tag =:= ap_rcpt_want_origin ->
            G#g{received = N + 1, received_bytes = B + erlang:external_size(Msg)};
        _ ->
            G
    end;
count_in(_Msg, G) ->
    G.

%% Unique per start and increasing across restarts of one node, even if
%% the clock steps back a little: a version tiebreak is never needed.
incarnation() ->
    erlang:system_time(microsecond) bsl 16 + (erlang:unique_integer([positive]) band 16#ffff).

%% ===================================================================
%% Completeness
%% ===================================================================

complete(#g{probing = Pr, peers = Peers}) ->
    map_size(Pr) =:= 0 andalso
        lists:all(fun(#peer{synced = S}) -> S end, maps:values(Peers)).

%% Subscriptions held for a complete view go out once it is.
release(#g{waiting = []} = G) ->
    G;
release(#g{waiting = W} = G) ->
    case complete(G) of
        true -> lists:foldl(fun({Id, Pid}, S) -> effect({subscribe, Id, Pid}, S) end,
                            G#g{waiting = []}, W);
        false -> G
    end.
