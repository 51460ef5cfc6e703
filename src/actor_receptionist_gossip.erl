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
%% a digest, its own `{Inc, Ver}' and the origins it reaches directly with
%% theirs, to `fanout' members picked at random (2 by default), to the
%% members it holds relayed origins through and to its followers; a member
%% answers a digest with its own. A digest that shows a member (or the
%% sender) at a newer version than the one held asks that member for its
%% state, so a lost delta is repaired within about a round, and each member
%% sends about 2 * fanout digests of O(N) entries a round (in 0.1.0 it sent
%% one to every member: N^2 messages and N^3 entries a round across the
%% cluster; see docs/scaling.md and the simulator,
%% support/ap_gossip_sim.erl). A state asked for and not come is asked once
%% more a quarter round later, and again every round until it comes.
%% Digests also relay origins one hop: a node that cannot reach an origin
%% asks a member that reaches it directly, and drops it when no member it
%% hears from lists it as direct any more (split horizon: an origin is
%% never listed back to the node it came through, and a relayed origin is
%% never relayed again, so two nodes cannot keep a dead origin alive
%% between them).
%%
%% <h3>Hidden nodes: followers</h3>
%% A BEAM started with `-hidden' is no member. Its receptionist follows
%% the nodes it connects to instead: it says `follow' rather than hello, and
%% a member answers with its state and then sends it its deltas and digests,
%% without asking for a state back or counting it for completeness. Other
%% members' registrations reach a follower as relayed origins. A follower's
%% own registrations are made on a member it follows (see
%% actor_receptionist_server), so they live as long as its connection to
%% that member. A BEAM without the application answers a probe at once
%% (the monitor's `DOWN') and is probed again every ten rounds, as its
%% application may start later. A C node (a pool node the follower calls)
%% cannot answer: it takes no monitor of a name. Its probe stops being
%% waited for after three gossip rounds, and it is not probed again while
%% its connection lasts (it never turns into a member).
%%
%% <h3>Removal</h3>
%% On `nodedown' of any node (hidden ones too) the server deregisters its
%% own registrations whose refs live on that node, and those changes
%% replicate like any other. A member's own registrations go with it
%% everywhere (`drop_origin').
-module(actor_receptionist_gossip).

-include("actor_pool_int.hrl").
-include("actor_receptionist_int.hrl").

-export([new/3, new_with_io/3]).
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

-export_type([state/0, effect/0, status/0, env/0, io/0]).

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

-type io() :: #{self => pid(),
                node => node(),
                hidden => boolean(),
                send => fun((pid() | {atom(), node()}, term()) -> ok | term()),
                monitor => fun((pid() | {atom(), node()}) -> reference()),
                demonitor => fun((reference()) -> term()),
                nodes => fun((visible | connected) -> [node()]),
                timer => fun((pos_integer(), term()) -> term()),
                incarnation => fun(() -> non_neg_integer()),
                seed => integer(),
                fanout := pos_integer() | all}.
%% The outside world as the core sees it (new_with_io/3). `send' answers `ok' when
%% the message went out; a monitor's `DOWN' and node events come back
%% through handle/3 like any other message.

%% Ops per delta message.
-define(MAX_DELTA, 4096).

-record(peer, {
    pid :: pid(),
    mref :: reference(),
    %% its state has been received since it (re)appeared
    synced = false :: boolean(),
    %% we asked it for its state this round and have no answer yet
    asked = false :: boolean(),
    %% a version of it seen elsewhere (a digest, a delta past a gap) that
    %% we do not hold yet: asked for every round until we do
    wanted = none :: none | {non_neg_integer(), non_neg_integer()},
    %% the origins it reached directly as of its last digest, those we do
    %% not reach ourselves
    direct = #{} :: #{node() => {non_neg_integer(), non_neg_integer()}}
}).

-record(g, {
    inc :: non_neg_integer(),
    %% the outside world (real_io/0, or the simulator's), and what of it is
    %% used on every message
    io :: io(),
    self :: pid(),
    node :: node(),
    fanout :: pos_integer() | all,
    %% picks the members a digest goes to
    rand :: rand:state(),
    %% a {?MODULE, retry} is on its way
    retry = false :: boolean(),
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
    %% (on a follower) connected nodes whose probe came back `DOWN' (a BEAM
    %% with no receptionist): rounds until they are probed again (its
    %% receptionist may start later)
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
-spec new(pos_integer(), [node()], pos_integer()) -> state().
new(Interval, CNodes, Fanout) ->
    ok = net_kernel:monitor_nodes(true, [{node_type, all}]),
    new_with_io(Interval, CNodes, #{fanout => Fanout}).

%% @private
%% @doc new/3 with the outside world replaced (see io()): the simulator
%% (support/ap_gossip_sim.erl) runs a thousand members in one process this
%% way. Missing keys take the real thing but `fanout' (required): the
%% number of random members a digest goes to each round (`all': every
%% member, the protocol of 0.1.0, kept for comparison).
-spec new_with_io(pos_integer(), [node()], io()) -> state().
new_with_io(Interval, CNodes, Io0) ->
    #{fanout := Fanout} = Io0,
    Io = maps:merge(real_io(), Io0),
    #{self := Self, node := Node, hidden := Hidden, incarnation := IncF, seed := Seed} = Io,
    Inc = IncF(),
    G0 = #g{inc = Inc, interval = Interval, hidden = Hidden, io = Io, self = Self,
            node = Node, fanout = Fanout,
            rand = rand:seed_s(exsss, {Seed, Inc band 16#ffffffff, Inc bsr 32})},
    G = lists:foldl(fun probe/2, G0, candidates(CNodes, G0)),
    ok = io_timer(Interval, {?MODULE, tick}, G),
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
    ok = io_timer(Interval, {?MODULE, tick}, G0),
    %% Sends may be dropped (nosuspend): a hello or a state that never came
    %% is asked for again, once per round. A probe unanswered for three
    %% rounds, with no DOWN either, went to a node that takes no monitor of
    %% a name, a C node: it is not waited for any more, nor probed again
    %% (every probe would make the view incomplete for three rounds again).
    Pr = maps:filtermap(fun(_, {Mref, 0}) -> io_demonitor(Mref, G0), false;
                           (_, {Mref, N}) -> {true, {Mref, N - 1}}
                        end, Pr0),
    G1 = reprobe(G0#g{peers = maps:map(fun(_, P) -> P#peer{asked = false} end, Peers),
                      probing = Pr}),
    G2 = maps:fold(fun(Node, _, S) -> out({?RCPT_SERVER, Node}, hello(S), S) end, G1, Pr),
    %% A member whose state never came, or whose version seen elsewhere we
    %% still lack, is asked again here: its own digests reach us only now
    %% and then.
    G = maps:fold(fun(Node, P, S) ->
                          case missing(Node, P, S) of
                              false -> S;
                              true -> ask(Node, S);
                              done -> S#g{peers = (S#g.peers)#{Node := P#peer{wanted = none}}}
                          end
                  end, G2, G2#g.peers),
    digest(flush(G));
handle1({?MODULE, retry}, _Env, #g{peers = Peers} = G0) ->
    %% A quarter round after asking: a hello or a state lost on the way is
    %% asked for once more now, not a round later (a change that missed a
    %% member then reaches it within about a round even at 1% loss). Once
    %% a round at most: the flags reset at the tick.
    maps:fold(fun(Node, #peer{asked = true, pid = Pid} = P, S) ->
                      case missing(Node, P, S) of
                          true -> out(Pid, hello(S), S);
                          _ -> S
                      end;
                 (_, _, S) ->
                      S
              end, G0#g{retry = false}, Peers);
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
            case G1#g.hidden andalso lists:member(Node, io_nodes(connected, G1)) of
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
                 _ = [io_demonitor(M, G0) || {ok, #peer{mref = M}} <- [Old]],
                 G0#g{followers = Fs#{Node => #peer{pid = Pid, mref = io_monitor(Pid, G0)}}}
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
            want(Node, {Inc, To}, G);
        _ ->
            %% Not (yet) a member here: a hello gets its state.
            ask(Node, peer(Pid, G))
    end;
handle1({Tag, Pid, Inc, Ver, Direct}, _Env, G0)
  when Tag =:= ap_rcpt_digest orelse Tag =:= ap_rcpt_digest_back, is_pid(Pid), is_list(Direct) ->
    Node = node(Pid),
    case maps:find(Node, G0#g.peers) of
        {ok, #peer{pid = Pid} = P} ->
            Listed = maps:from_list([{O, {I, V}} || {O, I, V} <- Direct, is_atom(O)]),
            %% Kept for reroute/2: only what we may need relayed (in a full
            %% mesh, nothing), not N entries for each of N members.
            Relayable = maps:filter(fun(O, _) -> O =/= G0#g.node andalso
                                                     not is_map_key(O, G0#g.peers) end, Listed),
            G1 = G0#g{peers = (G0#g.peers)#{Node := P#peer{direct = Relayable}}},
            G2 = case maps:find(Node, G1#g.origins) of
                     {ok, {Inc, Ver, direct}} -> G1;
                     _ -> want(Node, {Inc, Ver}, G1)
                 end,
            G3 = relayed(Pid, Listed, G2),
            case Tag of
                ap_rcpt_digest -> answer(Pid, G3);
                ap_rcpt_digest_back -> G3
            end;
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
    Mine = Origin =:= G#g.node orelse maps:is_key(Origin, G#g.peers),
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
            Mref = io_monitor({?RCPT_SERVER, Node}, G),
            G1 = out({?RCPT_SERVER, Node}, hello(G), G),
            G1#g{probing = Pr#{Node => {Mref, 3}}}
    end.

%% (follower) A connected node whose probe came back DOWN (it runs no
%% receptionist) is probed again after ten rounds; a member's is not
%% waited for meanwhile.
nonmember(Node, #g{hidden = true, nonmembers = NMs} = G) ->
    G#g{nonmembers = NMs#{Node => 10}};
nonmember(_Node, G) ->
    G.

reprobe(#g{hidden = false} = G) ->
    G;
reprobe(#g{nonmembers = NMs} = G0) ->
    {Due, Wait} = lists:partition(fun({_, N}) -> N =< 0 end, maps:to_list(NMs)),
    G = G0#g{nonmembers = maps:from_list([{Node, N - 1} || {Node, N} <- Wait])},
    Connected = io_nodes(connected, G),
    lists:foldl(fun({Node, _}, S) ->
                        case lists:member(Node, Connected) of
                            true -> probe(Node, S);
                            false -> S
                        end
                end, G, Due).

%% A follower asks to follow; a member says hello.
hello(#g{inc = Inc, hidden = true, self = Self}) ->
    {ap_rcpt_follow, Self, Inc};
hello(#g{inc = Inc, self = Self}) ->
    {ap_rcpt_hello, Self, Inc}.

%% The nodes to probe at start: visible ones; a hidden node has only hidden
%% connections, its own C nodes aside.
candidates(_CNodes, #g{hidden = false} = G) ->
    io_nodes(visible, G);
candidates(CNodes, #g{hidden = true} = G) ->
    io_nodes(connected, G) -- CNodes.

forget_probe(Node, #g{probing = Pr} = G) ->
    case maps:take(Node, Pr) of
        {{Mref, _}, Pr1} -> io_demonitor(Mref, G), G#g{probing = Pr1};
        error -> G
    end.

%% Pid is the receptionist server of a member: record (and monitor) it.
peer(Pid, #g{peers = Peers} = G) ->
    Node = node(Pid),
    New = fun() -> #peer{pid = Pid, mref = io_monitor(Pid, G)} end,
    case maps:find(Node, Peers) of
        {ok, #peer{pid = Pid}} ->
            G;
        {ok, #peer{mref = Old}} ->
            %% A new incarnation: the old one's refs go when its state comes.
            io_demonitor(Old, G),
            G#g{peers = Peers#{Node := New()}};
        error ->
            G#g{peers = Peers#{Node => New()}}
    end.

ask_if_unsynced(Node, G) ->
    case maps:get(Node, G#g.peers) of
        #peer{synced = true} -> G;
        _ -> ask(Node, G)
    end.

%% Whether we still lack a member's state, or a version of it seen
%% elsewhere (`done': we hold that version now).
missing(_Node, #peer{synced = false}, _G) ->
    true;
missing(_Node, #peer{wanted = none}, _G) ->
    false;
missing(Node, #peer{wanted = W}, #g{origins = Os}) ->
    case maps:find(Node, Os) of
        {ok, {I, V, direct}} when {I, V} >= W -> done;
        _ -> true
    end.

%% A member's version Want is known to exist: ask for its state now, and
%% every round until we hold it (or a newer one).
want(Node, Want, #g{peers = Peers} = G) ->
    case maps:find(Node, Peers) of
        {ok, #peer{wanted = W} = P} when W =:= none; W < Want ->
            ask(Node, G#g{peers = Peers#{Node := P#peer{wanted = Want}}});
        _ ->
            ask(Node, G)
    end.

%% Ask a member for its whole state (a hello), once a round.
ask(Node, #g{peers = Peers} = G) ->
    case maps:find(Node, Peers) of
        {ok, #peer{asked = true}} ->
            G;
        {ok, #peer{pid = Pid} = P} ->
            G1 = retry_later(out(Pid, hello(G), G)),
            G1#g{peers = Peers#{Node := P#peer{asked = true}}};
        error ->
            G
    end.

retry_later(#g{retry = true} = G) ->
    G;
retry_later(#g{interval = Interval} = G) ->
    ok = io_timer(max(1, Interval div 4), {?MODULE, retry}, G),
    G#g{retry = true}.

member_left(Node, #g{peers = Peers} = G0) ->
    G1 = case maps:take(Node, Peers) of
             {#peer{mref = Mref}, Peers1} ->
                 io_demonitor(Mref, G0),
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
           fun(O, _, G) when O =:= G#g.node -> G;
              (O, {I, V}, #g{origins = Os} = G) ->
                   case maps:find(O, Os) of
                       %% A delta of a member that never reached us (its
                       %% own digests go to a few members a round): its
                       %% state fixes that.
                       {ok, {HI, HV, direct}} when {HI, HV} < {I, V} -> want(O, {I, V}, G);
                       _ when is_map_key(O, Peers) -> G;
                       {ok, {_, _, direct}} -> G;
                       {ok, {I, V, _}} -> G;
                       {ok, {_, _, Via}} -> out(Pid, {ap_rcpt_want_origin, G#g.self, O}, G);
                       {ok, {_, _, _Other}} -> G;
                       error -> out(Pid, {ap_rcpt_want_origin, G#g.self, O}, G)
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
            out(Pid, {ap_rcpt_want_origin, G#g.self, Origin}, G1);
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
    Msg = {ap_rcpt_delta, G#g.self, Inc, From, To, Now},
    G1 = maps:fold(fun(_, #peer{pid = Pid}, S) -> out(Pid, Msg, S) end, G, Peers),
    send_deltas(Rest, To, Inc, Peers, G1).

split(L, N) when length(L) =< N -> {L, []};
split(L, N) -> lists:split(N, L).

%% The journal is written in the same process, so this is version Ver.
send_state(Pid, Journal, #g{inc = Inc, ver = Ver} = G) ->
    out(Pid, {ap_rcpt_state, G#g.self, Inc, Ver, Journal()}, G).

%% Our own version and the origins we reach directly (never the receiver
%% itself, nor relayed ones: one hop), to `fanout' random members, to the
%% members we hold relayed origins through (their answer says whether they
%% still reach them) and to our followers. A member answers with its own
%% digest, so one exchange repairs both sides: a change a member missed
%% reaches it within about a round, and each member sends about 2 * fanout
%% digests of O(N) entries a round, where sending one to every member made
%% that O(N) digests (N^2 messages, N^3 entries a round in the cluster).
digest(#g{hidden = true} = G) ->
    %% A follower is no member: it asks (follow) when it finds a gap.
    G;
digest(#g{peers = Peers, followers = Fs, origins = Os, fanout = all} = G) ->
    send_digest(ap_rcpt_digest, maps:keys(maps:merge(Fs, Peers)), direct(Os), G);
digest(#g{peers = Peers, followers = Fs, origins = Os, fanout = K, rand = R0} = G) ->
    {Random, R} = pick(K, maps:keys(Peers), R0, []),
    Relays = [V || {_, {_, _, V}} <- maps:to_list(Os), V =/= direct, is_map_key(V, Peers)],
    To = lists:usort(Random ++ Relays ++ maps:keys(Fs)),
    send_digest(ap_rcpt_digest, To, direct(Os), G#g{rand = R}).

%% A member's digest gets ours back (a follower sends none; with fanout
%% `all' every member gets ours anyway).
answer(_Pid, #g{hidden = true} = G) ->
    G;
answer(_Pid, #g{fanout = all} = G) ->
    G;
answer(Pid, #g{origins = Os} = G) ->
    send_digest(ap_rcpt_digest_back, [node(Pid)], direct(Os), G).

direct(Os) ->
    [{O, I, V} || {O, {I, V, direct}} <- maps:to_list(Os)].

send_digest(Tag, Nodes, Direct, #g{peers = Peers, followers = Fs, inc = Inc, ver = Ver,
                                   self = Self} = G) ->
    lists:foldl(fun(Node, S) ->
                        #peer{pid = Pid} = case maps:find(Node, Peers) of
                                               {ok, P} -> P;
                                               error -> maps:get(Node, Fs)
                                           end,
                        out(Pid, {Tag, Self, Inc, Ver, [D || {O, _, _} = D <- Direct, O =/= Node]}, S)
                end, G, Nodes).

%% K distinct members at random (all of them if there are no more).
pick(0, _L, R, Acc) ->
    {Acc, R};
pick(_K, [], R, Acc) ->
    {Acc, R};
pick(K, L, R0, Acc) ->
    {I, R} = rand:uniform_s(length(L), R0),
    {Before, [X | After]} = lists:split(I - 1, L),
    pick(K - 1, Before ++ After, R, [X | Acc]).

%% Never block on a busy or reconnecting distribution channel: what is lost
%% is repaired by the next digest.
out(Dest, Msg, #g{io = #{send := Send}} = G) ->
    case Send(Dest, Msg) of
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
                 Tag =:= ap_rcpt_digest; Tag =:= ap_rcpt_digest_back;
                 Tag =:= ap_rcpt_want_origin ->
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
%% The outside world
%% ===================================================================

%% What a receptionist server really does; the simulator passes its own.
real_io() ->
    #{self => self(),
      node => node(),
      hidden => init:get_argument(hidden) =/= error,
      send => fun(Dest, Msg) -> erlang:send(Dest, Msg, [noconnect, nosuspend]) end,
      monitor => fun(Target) -> erlang:monitor(process, Target) end,
      demonitor => fun(Mref) -> erlang:demonitor(Mref, [flush]) end,
      nodes => fun erlang:nodes/1,
      timer => fun(Ms, Msg) -> erlang:send_after(Ms, self(), Msg) end,
      incarnation => fun incarnation/0,
      seed => erlang:phash2(node())}.

io_monitor(Target, #g{io = #{monitor := F}}) ->
    F(Target).

io_demonitor(Mref, #g{io = #{demonitor := F}}) ->
    _ = F(Mref),
    ok.

io_nodes(Kind, #g{io = #{nodes := F}}) ->
    F(Kind).

io_timer(Ms, Msg, #g{io = #{timer := F}}) ->
    _ = F(Ms, Msg),
    ok.

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
