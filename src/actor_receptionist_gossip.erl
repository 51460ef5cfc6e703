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
%% <h3>Channels: what a message is believed to say</h3>
%% A message does not say who sent it, and any process of any connected
%% node can put any pid in one. So nothing a member says about its own
%% registrations is taken from a message sent to this server's pid or name:
%% it is taken only from a message that arrives tagged with an alias (a
%% monitor alias, OTP 24) that this server made for that member's node and
%% handed to no one but the process registered as
%% `actor_receptionist_server' there. Per other node N:
%% <ol>
%% <li>we monitor `{actor_receptionist_server, N}' by name with an alias,
%%     In, and send `{ap_rcpt2_hello, In, Kind}' to that name (Kind: what
%%     we are, `member' or `follower'). Only a process on N can get it;</li>
%% <li>N answers a hello (its own probe of us made first, if it had none)
%%     with `{ap_rcpt2, In, {welcome, InN}}', InN being the alias N made
%%     for us, sent to our server by name (`{actor_receptionist_server,
%%     node(In)}'), so whatever a forged hello names, N's alias for us
%%     reaches no process but our server, and our server takes a welcome
%%     only tagged with an alias of its own;</li>
%% <li>a welcome that arrives tagged In comes from N's server: its InN is
%%     where we send N everything from then on, `{ap_rcpt2, InN, Body}'
%%     (only N's server holds InN), and N takes it as ours for the same
%%     reason. Every body (state, delta, digest, a relay request or answer,
%%     a follower's registration) is taken as N's by the In it carries,
%%     never by a pid in it.</li>
%% </ol>
%% A message tagged with an alias we do not hold (made up, or of a channel
%% closed since: closing it deactivates the alias too) is dropped and
%% counted (`rejected'), as is any message of the older protocol (0.x
%% receptionists, whose messages carry a pid as their sender): mixed
%% versions do not exchange registrations. Nothing is made for a hello from
%% a node that is not connected (no monitor, which would connect). An
%% alias is not a cryptographic secret (references are counters), so this
%% keeps any process but a member's server (one that holds the server's
%% pid, on any node, that member's included) from speaking for that
%% member; it is no defence against a node that runs code on this one or
%% on the member, which distributed Erlang allows any connected node
%% anyway.
%%
%% <h3>Membership</h3>
%% The members are the visible nodes whose BEAM runs a receptionist. On
%% `nodeup' of a visible node the server probes it as above; a `noproc' at
%% once means the node runs none (it says hello itself if it starts one
%% later). A member leaves with `nodedown' or when its server ends (its
%% receptionist stopped or restarted: a new incarnation), which the monitor
%% behind the channel reports.
%%
%% <h3>Replication</h3>
%% Each node is authoritative for its own registrations (the server's
%% journal) and numbers its changes: incarnation `Inc' (fresh per start of
%% the server) and version `Ver' (one per change). Changes go to every
%% member as a delta `{FromVer, ToVer, Ops}', one per burst. Each side sends
%% its whole state when a channel opens (on the welcome). A member that
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
%%
%% <h3>Relays</h3>
%% Digests also relay origins one hop: a node that cannot reach an origin
%% asks a member that reaches it directly, and drops it when no member it
%% hears from lists it as direct any more (split horizon: an origin is
%% never listed back to the node it came through, and a relayed origin is
%% never relayed again, so two nodes cannot keep a dead origin alive
%% between them). Node names in digests and relay messages are binaries:
%% one that names no existing atom stays a binary until a relayed state for
%% it is taken, and that happens only when the member that sends it listed
%% the origin as direct in its own last digest and was asked for it. So an
%% origin that is neither a member nor relayed by one costs no atom, no
%% table and no origin slot in the C node.
%%
%% <h3>Hidden nodes: followers</h3>
%% A BEAM started with `-hidden' is no member. Its receptionist follows
%% the nodes it connects to instead: its hello says `follower', and a
%% member opens a channel to it the same way, sends it its state and then
%% its deltas and digests, without asking for a state back or counting it
%% for completeness. Other members' registrations reach a follower as
%% relayed origins. A follower's own registrations are made on the members
%% it follows, over the same channels (`forwarded', and its whole journal
%% each time a member's state reaches it), so they live as long as its
%% connection to one of them. A BEAM without the application answers a
%% probe at once (the monitor's `DOWN') and is probed again every ten
%% rounds, as its application may start later. A C node (a pool node the
%% follower calls) cannot answer: it takes no monitor of a name. Its probe
%% stops being waited for after three gossip rounds, and it is not probed
%% again while its connection lasts (it never turns into a member).
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
-export([forward/4]).
-export([handle/3]).
-export([hold/3]).
-export([cancel/3]).
-export([status/1]).
-export([bytes/1]).
-export([sent/2]).
-export([origin_state/5]).
-export([hidden/1]).

-export_type([state/0, effect/0, status/0, env/0, io/0]).

-type status() :: #{complete := boolean(),
                    members := [node()],
                    syncing := [node()],
                    origins := #{node() => {non_neg_integer(), non_neg_integer()}},
                    incarnation := non_neg_integer(),
                    version := non_neg_integer(),
                    gossip := #{sent | sent_bytes | received | received_bytes | full_syncs
                                | member_drops | rejected => non_neg_integer()}}.

-type op() :: {reg | dereg, binary(), pid()}.

-type effect() :: {remote, node(), [op()]}
                | {replace_origin, node(), [{binary(), pid()}]}
                | {drop_origin, node()}
                | {origin_state, reference(), node(), non_neg_integer(), non_neg_integer()}
                | {drop_refs_on, node()}
                | {subscribe, binary(), pid()}
                | {followed, node(), register | deregister, binary(), pid()}
                | {followed_sync, node(), [term()]}
                | {old_protocol, node()}.
%% What the server must do with its tables and its C node, in order.
%% `origin_state': send origin_state/5 of what we hold of that origin to
%% the alias. `followed' / `followed_sync': a follower's registration, or
%% its whole journal. `old_protocol': that node speaks the gossip of an
%% older version (said once per node).

-type env() :: #{journal := fun(() -> [{binary(), pid()}]),
                 cnodes := [node()]}.
%% What the caller knows: its journal, read only when a member asks for our
%% state (it costs O(registrations)) and in the same step as our version;
%% and the C nodes of this BEAM, which connect to it hidden and are never
%% probed.

-type io() :: #{node => node(),
                hidden => boolean(),
                send => fun((reference() | {atom(), node()}, term()) -> ok | term()),
                monitor => fun(({atom(), node()}) -> reference()),
                demonitor => fun((reference()) -> term()),
                nodes => fun((visible | connected) -> [node()]),
                timer => fun((pos_integer(), term()) -> term()),
                incarnation => fun(() -> non_neg_integer()),
                seed => integer(),
                fanout := pos_integer() | all}.
%% The outside world as the core sees it (new_with_io/3). `send' answers `ok' when
%% the message went out; `monitor' monitors a registered name and makes the
%% monitor's reference an alias of the caller, which `demonitor' (or the
%% monitor's `DOWN') deactivates; a `DOWN' and node events come back
%% through handle/3 like any other message.

%% Ops per delta message.
-define(MAX_DELTA, 4096).
%% Bytes of a node name (255 characters of UTF-8).
-define(MAX_NODE_BYTES, 1020).
-define(IS_NAME(B), (is_binary(B) andalso byte_size(B) > 0 andalso byte_size(B) =< ?MAX_NODE_BYTES)).
-define(IS_VER(X), (is_integer(X) andalso X >= 0)).
%% The older protocol's messages: each carries a pid as its sender.
-define(OLD_TAGS, [ap_rcpt_hello, ap_rcpt_follow, ap_rcpt_state, ap_rcpt_delta, ap_rcpt_digest,
                   ap_rcpt_digest_back, ap_rcpt_want_origin, ap_rcpt_origin_state]).

-record(peer, {
    %% our alias for it: what it sends us carries this, and its DOWN (the
    %% monitor of its server) closes the channel
    in :: reference(),
    %% its alias for us, from its welcome: what we send it goes there
    out :: reference(),
    %% its state has been received since it (re)appeared
    synced = false :: boolean(),
    %% we asked it for its state this round and have no answer yet
    asked = false :: boolean(),
    %% a version of it seen elsewhere (a digest, a delta past a gap) that
    %% we do not hold yet: asked for every round until we do
    wanted = none :: none | {non_neg_integer(), non_neg_integer()},
    %% the origins it reached directly as of its last digest, those we do
    %% not reach ourselves, by name (a binary)
    direct = #{} :: #{binary() => {non_neg_integer(), non_neg_integer()}},
    %% the origins we asked it to relay and have no state of yet
    wants = #{} :: #{binary() => true}
}).

%% A channel opened (hello sent) and not welcomed yet. `rel': what the
%% other node will be to us, a member (peers) or a follower (followers).
-record(probe, {
    in :: reference(),
    rounds :: non_neg_integer(),
    rel :: member | follower
}).

-record(g, {
    inc :: non_neg_integer(),
    %% the outside world (real_io/0, or the simulator's), and what of it is
    %% used on every message
    io :: io(),
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
    %% nodes said hello to and not welcomed yet: the rounds left before
    %% one stops being waited for
    probing = #{} :: #{node() => #probe{}},
    %% every alias of ours that is open (probing, peers, followers): its node
    chans = #{} :: #{reference() => node()},
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
    %% connected nodes found speaking the older protocol (said once)
    old = #{} :: #{node() => true},
    %% gossip bytes handed to distribution (external size)
    bytes = 0 :: non_neg_integer(),
    %% counters for status/1's `gossip' (the metrics): messages handed to
    %% distribution, messages and bytes taken in, whole states taken in,
    %% members that left, messages dropped as not from whom they claim
    msgs_sent = 0 :: non_neg_integer(),
    received = 0 :: non_neg_integer(),
    received_bytes = 0 :: non_neg_integer(),
    full_syncs = 0 :: non_neg_integer(),
    member_drops = 0 :: non_neg_integer(),
    rejected = 0 :: non_neg_integer()
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
    #{node := Node, hidden := Hidden, incarnation := IncF, seed := Seed} = Io,
    Inc = IncF(),
    G0 = #g{inc = Inc, interval = Interval, hidden = Hidden, io = Io, node = Node,
            fanout = Fanout,
            rand = rand:seed_s(exsss, {Seed, Inc band 16#ffffffff, Inc bsr 32})},
    G = lists:foldl(fun(N, S) -> probe(N, member, S) end, G0, candidates(CNodes, G0)),
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
%% @doc (On a follower) a registration of this node, made on every member
%% it follows too; `G' unchanged on a member.
-spec forward(register | deregister, binary(), pid(), state()) -> state().
forward(Op, Id, Ref, #g{hidden = true, peers = Peers} = G) ->
    maps:fold(fun(_, #peer{out = Out}, S) -> chan_out(Out, {forwarded, Op, Id, Ref}, S) end,
              G, Peers);
forward(_Op, _Id, _Ref, G) ->
    G.

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
status(#g{peers = Peers, origins = Os, inc = Inc, ver = Ver} = G) ->
    #{gossip => #{sent => G#g.msgs_sent, sent_bytes => G#g.bytes, received => G#g.received,
                  received_bytes => G#g.received_bytes, full_syncs => G#g.full_syncs,
                  member_drops => G#g.member_drops, rejected => G#g.rejected},
      complete => complete(G),
      members => lists:sort(maps:keys(Peers)),
      syncing => lists:usort(member_probes(G) ++
                                 [N || {N, #peer{synced = false}} <- maps:to_list(Peers)]),
      origins => maps:map(fun(_, {I, V, _}) -> {I, V} end, Os),
      incarnation => Inc,
      version => Ver}.

%% @private
-spec hidden(state()) -> boolean().
hidden(#g{hidden = H}) ->
    H.

%% @private
-spec bytes(state()) -> non_neg_integer().
bytes(#g{bytes = B}) ->
    B.

%% @private
%% @doc The message that relays Origin's registrations (Regs, exactly
%% version {Inc, Ver}) to the member or follower whose alias for us is To
%% (an `origin_state' effect).
-spec origin_state(reference(), node(), non_neg_integer(), non_neg_integer(),
                   [{binary(), pid()}]) -> term().
origin_state(To, Origin, Inc, Ver, Regs) ->
    {ap_rcpt2, To, {origin_state, atom_to_binary(Origin, utf8), Inc, Ver, Regs}}.

%% ===================================================================
%% Messages
%% ===================================================================

handle1({?MODULE, tick}, _Env, #g{interval = Interval, peers = Peers, probing = Pr0} = G0) ->
    ok = io_timer(Interval, {?MODULE, tick}, G0),
    %% Sends may be dropped (nosuspend): a hello or a state that never came
    %% is asked for again, once per round. A probe unanswered for three
    %% rounds (no DOWN either: a C node, a mute server) is not waited for
    %% any more. A member keeps saying hello to it every round (its answer
    %% may just have been lost, and the other side may hold a channel to
    %% us that only our hello repairs); a follower gives up on it for the
    %% connection's life (a C node never turns into a member, and every
    %% probe would make the view incomplete for three rounds again).
    {Expired, Live} = lists:partition(fun({_, #probe{rounds = R}}) -> R =:= 0 andalso G0#g.hidden end,
                                      maps:to_list(Pr0)),
    G1 = lists:foldl(fun({_Node, #probe{in = In}}, S) -> close(In, S) end,
                     G0#g{peers = maps:map(fun(_, P) -> P#peer{asked = false} end, Peers),
                          probing = maps:from_list([{N, P#probe{rounds = max(0, R - 1)}}
                                                    || {N, #probe{rounds = R} = P} <- Live])},
                     Expired),
    %% (A node heard speaking the older protocol gets no hello once it is
    %% not waited for: it would log each as unexpected.)
    G2 = maps:fold(fun(Node, #probe{in = In, rounds = R}, S) when R > 0; not is_map_key(Node, S#g.old) ->
                           out({?RCPT_SERVER, Node}, hello(In, S), S);
                      (_, _, S) ->
                           S
                   end, reprobe(G1), G1#g.probing),
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
    maps:fold(fun(Node, #peer{asked = true, out = Out} = P, S) ->
                      case missing(Node, P, S) of
                          true -> chan_out(Out, ask, S);
                          _ -> S
                      end;
                 (_, _, S) ->
                      S
              end, G0#g{retry = false}, Peers);
handle1({nodeup, Node, Info}, #{cnodes := CNodes}, #g{hidden = Hidden} = G) when is_list(Info) ->
    case proplists:get_value(node_type, Info) of
        visible -> probe(Node, member, G);
        hidden when Hidden -> case lists:member(Node, CNodes) of
                                  true -> G;
                                  false -> probe(Node, member, G)
                              end;
        _ -> G
    end;
handle1({nodedown, Node, Info}, _Env, #g{nonmembers = NMs, old = Old} = G0) when is_list(Info) ->
    %% Our own registrations of processes on that node end, hidden or not.
    G1 = forget_follower(Node, forget_probe(Node, G0#g{nonmembers = maps:remove(Node, NMs),
                                                      old = maps:remove(Node, Old)})),
    member_left(Node, effect({drop_refs_on, Node}, G1));
handle1({'DOWN', In, process, {?RCPT_SERVER, Node}, _}, _Env, #g{chans = Chans} = G) ->
    %% That node runs no receptionist, or its receptionist ended (a new
    %% one, if it starts, says hello).
    case maps:find(In, Chans) of
        {ok, Node} -> down(Node, In, G);
        _ -> G
    end;
handle1({ap_rcpt2_hello, X, Kind}, Env, G) when is_reference(X) ->
    hello_from(node(X), X, Kind, Env, G);
handle1({ap_rcpt2, In, Body}, Env, #g{chans = Chans} = G) when is_reference(In) ->
    case maps:find(In, Chans) of
        {ok, Node} -> chan(Node, In, Body, Env, G);
        error -> rejected(G)
    end;
handle1(Msg, _Env, G) when is_tuple(Msg), tuple_size(Msg) >= 2 ->
    case lists:member(element(1, Msg), ?OLD_TAGS) of
        true -> old_protocol(element(2, Msg), rejected(G));
        false -> ignore
    end;
handle1(_, _Env, _G) ->
    ignore.

%% A hello: X, an alias on node Node, would be that node's receptionist's
%% for us. Nothing in it is believed: the answer, our alias for Node, goes
%% to Node's receptionist by name, tagged X, so it reaches that server only
%% and that server takes it only if X is its own. Nothing is made for a
%% node that is not connected or that we do not deal with.
hello_from(Node, X, Kind, #{cnodes := CNodes}, #g{hidden = Hidden} = G) ->
    Rel = case {Hidden, Kind} of
              {false, member} -> member;
              {false, follower} -> follower;
              %% Only members are followed: two hidden nodes never follow
              %% each other.
              {true, member} -> member;
              _ -> none
          end,
    Ok = Rel =/= none andalso Node =/= G#g.node andalso not lists:member(Node, CNodes)
        andalso lists:member(Node, io_nodes(connected, G)),
    case Ok of
        true ->
            Fresh = in_of(Node, G) =:= error,
            G1 = probe(Node, Rel, G),
            {ok, In, Out} = in_of(Node, G1),
            G2 = out({?RCPT_SERVER, Node}, {ap_rcpt2, X, {welcome, In}}, G1),
            %% Our own hello again, now rather than next round, if our
            %% probe was not welcomed yet (its server is there and answers:
            %% a welcome of ours or of its may just have been lost), or if
            %% it names another alias for us than the one we send to (its
            %% side was reopened, or the hello is made up): its server then
            %% welcomes us with the alias it really holds.
            case (Out =:= none andalso not Fresh) orelse (Out =/= X andalso Out =/= none) of
                true -> out({?RCPT_SERVER, Node}, hello(In, G2), G2);
                false -> G2
            end;
        false ->
            rejected(G)
    end.

%% A message on our channel for Node: it comes from Node's receptionist.
chan(Node, In, {welcome, W}, #{journal := Journal}, #g{probing = Pr} = G)
  when is_reference(W), node(W) =:= Node ->
    case maps:find(Node, Pr) of
        {ok, #probe{in = In, rel = Rel}} ->
            G1 = G#g{probing = maps:remove(Node, Pr)},
            P = #peer{in = In, out = W},
            case Rel of
                %% A member we follow sends us its state when it gets our
                %% welcome; it needs nothing of ours but what we forward.
                member when G#g.hidden ->
                    G1#g{peers = (G1#g.peers)#{Node => P}};
                member ->
                    send_state(W, Journal, flush(G1#g{peers = (G1#g.peers)#{Node => P}}));
                follower ->
                    send_state(W, Journal, flush(G1#g{followers = (G1#g.followers)#{Node => P}}))
            end;
        _ ->
            %% Open already: a welcome again (our hello crossed its), with
            %% the same alias or a new one of its.
            case link_of(Node, In, G) of
                {Key, #peer{out = W}} when Key =/= none ->
                    G;
                {peers, P} ->
                    G1 = G#g{peers = (G#g.peers)#{Node := P#peer{out = W}}},
                    case G#g.hidden of
                        true -> G1;
                        false -> send_state(W, Journal, flush(G1))
                    end;
                {followers, P} ->
                    send_state(W, Journal,
                               flush(G#g{followers = (G#g.followers)#{Node := P#peer{out = W}}}));
                {none, _} ->
                    rejected(G)
            end
    end;
chan(Node, In, ask, #{journal := Journal}, #g{hidden = false, probing = Pr} = G) ->
    case {link_of(Node, In, G), maps:find(Node, Pr)} of
        {{none, _}, {ok, #probe{in = In}}} ->
            %% It holds our alias, so it took our hello, and its welcome
            %% was lost: say hello again now, and answer its next ask.
            out({?RCPT_SERVER, Node}, hello(In, G), G);
        {{none, _}, _} ->
            rejected(G);
        {{_, #peer{out = Out}}, _} ->
            send_state(Out, Journal, flush(G))
    end;
chan(Node, In, {state, Inc, Ver, Regs}, #{journal := Journal}, #g{peers = Peers} = G0)
  when ?IS_VER(Inc), ?IS_VER(Ver), is_list(Regs) ->
    case maps:find(Node, Peers) of
        {ok, #peer{in = In, out = Out} = P} ->
            G1 = replace_origin(Node, Inc, Ver, direct, Regs, G0),
            G2 = G1#g{peers = Peers#{Node := P#peer{synced = true, asked = false}}},
            %% A follower's registrations are held by the members it
            %% follows: this one gets them all (again) now.
            case G2#g.hidden of
                true -> chan_out(Out, {forwarded_sync, Journal()}, G2);
                false -> G2
            end;
        _ ->
            rejected(G0)
    end;
chan(Node, In, {delta, Inc, From, To, Ops}, _Env, #g{peers = Peers, origins = Os} = G)
  when ?IS_VER(Inc), ?IS_VER(From), ?IS_VER(To), is_list(Ops) ->
    case {maps:find(Node, Peers), maps:find(Node, Os)} of
        {{ok, #peer{in = In}}, {ok, {Inc, From, direct}}} ->
            effect({remote, Node, Ops}, G#g{origins = Os#{Node := {Inc, To, direct}}});
        {{ok, #peer{in = In}}, {ok, {Inc, Ver, direct}}} when Ver >= To ->
            G;
        {{ok, #peer{in = In}}, _} ->
            %% A gap, or its state is still on the way.
            want(Node, {Inc, To}, G);
        _ ->
            rejected(G)
    end;
chan(Node, In, {Tag, Inc, Ver, Direct}, _Env, #g{peers = Peers} = G0)
  when (Tag =:= digest orelse Tag =:= digest_back), ?IS_VER(Inc), ?IS_VER(Ver),
       is_list(Direct) ->
    case maps:find(Node, Peers) of
        {ok, #peer{in = In, wants = Wants} = P} ->
            Listed = maps:from_list([{O, {I, V}} || {O, I, V} <- Direct, ?IS_NAME(O),
                                                    ?IS_VER(I), ?IS_VER(V)]),
            %% Kept for reroute/2 and to check a relayed state against:
            %% only what we may need relayed (in a full mesh, nothing), not
            %% N entries for each of N members.
            Relayable = maps:filter(fun(O, _) -> not ours(O, G0) end, Listed),
            G1 = G0#g{peers = Peers#{Node := P#peer{direct = Relayable,
                                                     wants = maps:with(maps:keys(Relayable), Wants)}}},
            G2 = case maps:find(Node, G1#g.origins) of
                     {ok, {Inc, Ver, direct}} -> G1;
                     _ -> want(Node, {Inc, Ver}, G1)
                 end,
            G3 = relayed(Node, Listed, G2),
            case Tag of
                digest -> answer(Node, G3);
                digest_back -> G3
            end;
        _ ->
            rejected(G0)
    end;
chan(Node, In, {want_origin, Name}, _Env, G) when ?IS_NAME(Name) ->
    %% Only origins we reach ourselves are relayed (one hop).
    case link_of(Node, In, G) of
        {none, _} ->
            rejected(G);
        {_, #peer{out = Out}} ->
            case existing(Name) of
                {ok, Origin} ->
                    case maps:find(Origin, G#g.origins) of
                        {ok, {Inc, Ver, direct}} -> effect({origin_state, Out, Origin, Inc, Ver}, G);
                        _ -> G
                    end;
                error ->
                    G
            end
    end;
chan(Via, In, {origin_state, Name, Inc, Ver, Regs}, _Env, #g{peers = Peers} = G0)
  when ?IS_NAME(Name), ?IS_VER(Inc), ?IS_VER(Ver), is_list(Regs) ->
    %% Taken only from a member that listed the origin as direct in its
    %% last digest and that we asked for it: only then does its name
    %% become an atom here.
    case maps:find(Via, Peers) of
        {ok, #peer{in = In, direct = D, wants = #{Name := true} = Wants} = P}
          when is_map_key(Name, D) ->
            G = G0#g{peers = Peers#{Via := P#peer{wants = maps:remove(Name, Wants)}}},
            case to_node(Name) of
                {ok, Origin} ->
                    Mine = Origin =:= G#g.node orelse maps:is_key(Origin, Peers),
                    Wanted = case maps:find(Origin, G#g.origins) of
                                 {ok, {I, V, _}} -> {I, V} =/= {Inc, Ver};
                                 error -> true
                             end,
                    case not Mine andalso Wanted of
                        true -> replace_origin(Origin, Inc, Ver, Via, Regs, G);
                        false -> G
                    end;
                error ->
                    rejected(G)
            end;
        _ ->
            rejected(G0)
    end;
chan(Node, In, {forwarded, Op, Id, Ref}, _Env, #g{followers = Fs} = G)
  when (Op =:= register orelse Op =:= deregister), ?IS_ID(Id), is_pid(Ref) ->
    case maps:find(Node, Fs) of
        {ok, #peer{in = In}} -> effect({followed, Node, Op, Id, Ref}, G);
        _ -> rejected(G)
    end;
chan(Node, In, {forwarded_sync, Regs}, _Env, #g{followers = Fs} = G) when is_list(Regs) ->
    case maps:find(Node, Fs) of
        {ok, #peer{in = In}} -> effect({followed_sync, Node, Regs}, G);
        _ -> rejected(G)
    end;
chan(_Node, _In, _Body, _Env, G) ->
    rejected(G).

rejected(#g{rejected = N} = G) ->
    G#g{rejected = N + 1}.

%% A message of the older protocol: said once per connected node (the pid
%% in it may lie, but only a log line rides on it).
old_protocol(Pid, #g{old = Old} = G) when is_pid(Pid) ->
    Node = node(Pid),
    case not is_map_key(Node, Old) andalso Node =/= G#g.node
        andalso lists:member(Node, io_nodes(connected, G)) of
        true -> effect({old_protocol, Node}, G#g{old = Old#{Node => true}});
        false -> G
    end;
old_protocol(_, G) ->
    G.

%% ===================================================================
%% Members
%% ===================================================================

%% Open a channel to Node's receptionist (Rel: what it will be to us),
%% unless one is open or opening.
probe(Node, Rel, #g{probing = Pr, peers = Peers, followers = Fs, chans = Chans} = G) ->
    case maps:is_key(Node, Pr) orelse maps:is_key(Node, Peers) orelse maps:is_key(Node, Fs) of
        true ->
            G;
        false ->
            In = io_monitor({?RCPT_SERVER, Node}, G),
            G1 = out({?RCPT_SERVER, Node}, hello(In, G), G),
            G1#g{probing = Pr#{Node => #probe{in = In, rounds = 3, rel = Rel}},
                 chans = Chans#{In => Node}}
    end.

%% Close our alias In (and the monitor behind it).
close(In, #g{chans = Chans} = G) ->
    io_demonitor(In, G),
    G#g{chans = maps:remove(In, Chans)}.

%% Our open alias for Node and its alias for us (`none' while probing),
%% or error.
in_of(Node, #g{probing = Pr, peers = Peers, followers = Fs}) ->
    case {maps:find(Node, Pr), maps:find(Node, Peers), maps:find(Node, Fs)} of
        {{ok, #probe{in = In}}, _, _} -> {ok, In, none};
        {_, {ok, #peer{in = In, out = Out}}, _} -> {ok, In, Out};
        {_, _, {ok, #peer{in = In, out = Out}}} -> {ok, In, Out};
        _ -> error
    end.

%% The member or follower whose channel In is.
link_of(Node, In, #g{peers = Peers, followers = Fs}) ->
    case {maps:find(Node, Peers), maps:find(Node, Fs)} of
        {{ok, #peer{in = In} = P}, _} -> {peers, P};
        {_, {ok, #peer{in = In} = P}} -> {followers, P};
        _ -> {none, none}
    end.

%% Our monitor of Node's server reported: it runs none, or it ended.
down(Node, In, #g{probing = Pr, peers = Peers} = G0) ->
    G = G0#g{chans = maps:remove(In, G0#g.chans)},
    case {maps:find(Node, Pr), maps:find(Node, Peers)} of
        {{ok, #probe{in = In, rel = member}}, _} ->
            nonmember(Node, G#g{probing = maps:remove(Node, Pr)});
        {{ok, #probe{in = In}}, _} ->
            G#g{probing = maps:remove(Node, Pr)};
        {_, {ok, #peer{in = In}}} ->
            %% Its receptionist ended; a new one says hello.
            G1 = member_left(Node, G),
            case G1#g.hidden andalso lists:member(Node, io_nodes(connected, G1)) of
                true -> G1#g{nonmembers = (G1#g.nonmembers)#{Node => 1}};
                false -> G1
            end;
        _ ->
            forget_follower(Node, G)
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
                            true -> probe(Node, member, S);
                            false -> S
                        end
                end, G, Due).

%% What we are, and the alias the answer goes to.
hello(In, #g{hidden = true}) ->
    {ap_rcpt2_hello, In, follower};
hello(In, #g{}) ->
    {ap_rcpt2_hello, In, member}.

%% The nodes to probe at start: visible ones; a hidden node has only hidden
%% connections, its own C nodes aside.
candidates(_CNodes, #g{hidden = false} = G) ->
    io_nodes(visible, G);
candidates(CNodes, #g{hidden = true} = G) ->
    io_nodes(connected, G) -- CNodes.

forget_probe(Node, #g{probing = Pr} = G) ->
    case maps:take(Node, Pr) of
        {#probe{in = In}, Pr1} -> close(In, G#g{probing = Pr1});
        error -> G
    end.

forget_follower(Node, #g{followers = Fs} = G) ->
    case maps:take(Node, Fs) of
        {#peer{in = In}, Fs1} -> close(In, G#g{followers = Fs1});
        error -> G
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

%% Ask a member for its whole state, once a round.
ask(Node, #g{peers = Peers} = G) ->
    case maps:find(Node, Peers) of
        {ok, #peer{asked = true}} ->
            G;
        {ok, #peer{out = Out} = P} ->
            G1 = retry_later(chan_out(Out, ask, G)),
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
             {#peer{in = In}, Peers1} ->
                 close(In, G0#g{peers = Peers1, member_drops = G0#g.member_drops + 1});
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

%% The origins member Via reaches directly (by name): fetch those we do not
%% reach ourselves and hold at another version (through this member, or
%% not at all); and a relayed origin its relay no longer lists moves to
%% another member that lists it, or goes.
relayed(Via, Listed, #g{peers = Peers} = G0) ->
    G1 = maps:fold(
           fun(Name, {I, V}, G) ->
                   case existing(Name) of
                       {ok, O} when O =:= G#g.node ->
                           G;
                       {ok, O} ->
                           case maps:find(O, G#g.origins) of
                               %% A delta of a member that never reached us
                               %% (its own digests go to a few members a
                               %% round): its state fixes that.
                               {ok, {HI, HV, direct}} when {HI, HV} < {I, V} -> want(O, {I, V}, G);
                               _ when is_map_key(O, Peers) -> G;
                               {ok, {_, _, direct}} -> G;
                               {ok, {I, V, _}} -> G;
                               {ok, {_, _, Via}} -> want_origin(Via, Name, G);
                               {ok, {_, _, _Other}} -> G;
                               error -> want_origin(Via, Name, G)
                           end;
                       error ->
                           %% No atom names it yet: we hold nothing of it.
                           want_origin(Via, Name, G)
                   end
           end, G0, Listed),
    Stale = [O || {O, {_, _, V}} <- maps:to_list(G1#g.origins), V =:= Via,
                  not maps:is_key(atom_to_binary(O, utf8), Listed)],
    lists:foldl(fun reroute/2, G1, Stale).

%% Ask member Via to relay origin Name, and remember we did.
want_origin(Via, Name, #g{peers = Peers} = G) ->
    case maps:find(Via, Peers) of
        {ok, #peer{out = Out, wants = W} = P} ->
            chan_out(Out, {want_origin, Name},
                     G#g{peers = Peers#{Via := P#peer{wants = W#{Name => true}}}});
        error ->
            G
    end.

%% Origin was relayed by a member that no longer does: fetch it from another
%% member that lists it as direct (the diff then keeps what stays), or drop
%% it.
reroute(Origin, #g{peers = Peers} = G) ->
    Name = atom_to_binary(Origin, utf8),
    case [N || {N, #peer{direct = D}} <- maps:to_list(Peers), maps:is_key(Name, D)] of
        [Via | _] ->
            Os = G#g.origins,
            {I, V, _} = maps:get(Origin, Os),
            want_origin(Via, Name, G#g{origins = Os#{Origin := {I, V, Via}}});
        [] ->
            drop_origin(Origin, G)
    end.

%% This node or one of its members: never relayed to it.
ours(Name, #g{node = Self, peers = Peers}) ->
    case existing(Name) of
        {ok, O} -> O =:= Self orelse is_map_key(O, Peers);
        error -> false
    end.

%% The atom a node name is, if one exists: nothing here makes one.
existing(Name) ->
    try {ok, binary_to_existing_atom(Name, utf8)}
    catch error:badarg -> error
    end.

%% A node name as an atom, made if need be: only for an origin a member
%% relays to us on request. `name@host', as net_kernel takes it.
to_node(Name) ->
    case existing(Name) of
        {ok, _} = Ok ->
            Ok;
        error ->
            case binary:split(Name, <<"@">>) of
                [N, H] when N =/= <<>>, H =/= <<>> ->
                    try {ok, binary_to_atom(Name, utf8)}
                    catch error:_ -> error
                    end;
                _ ->
                    error
            end
    end.

effect(E, #g{effects = Es} = G) ->
    G#g{effects = [E | Es]}.

%% ===================================================================
%% Sending
%% ===================================================================

%% On a channel: Out is the other side's alias for us, and the tag it
%% checks.
chan_out(Out, Body, G) ->
    out(Out, {ap_rcpt2, Out, Body}, G).

send_deltas([], _From, _Inc, _Peers, G) ->
    G;
send_deltas(Ops, From, Inc, Peers, G) ->
    {Now, Rest} = split(Ops, ?MAX_DELTA),
    To = From + length(Now),
    Body = {delta, Inc, From, To, Now},
    G1 = maps:fold(fun(_, #peer{out = Out}, S) -> chan_out(Out, Body, S) end, G, Peers),
    send_deltas(Rest, To, Inc, Peers, G1).

split(L, N) when length(L) =< N -> {L, []};
split(L, N) -> lists:split(N, L).

%% The journal is written in the same process, so this is version Ver.
send_state(Out, Journal, #g{inc = Inc, ver = Ver} = G) ->
    chan_out(Out, {state, Inc, Ver, Journal()}, G).

%% Our own version and the origins we reach directly (never the receiver
%% itself, nor relayed ones: one hop), to `fanout' random members, to the
%% members we hold relayed origins through (their answer says whether they
%% still reach them) and to our followers. A member answers with its own
%% digest, so one exchange repairs both sides: a change a member missed
%% reaches it within about a round, and each member sends about 2 * fanout
%% digests of O(N) entries a round, where sending one to every member made
%% that O(N) digests (N^2 messages, N^3 entries a round in the cluster).
digest(#g{hidden = true} = G) ->
    %% A follower is no member: it asks when it finds a gap.
    G;
digest(#g{peers = Peers, followers = Fs, origins = Os, fanout = all} = G) ->
    send_digest(digest, maps:keys(maps:merge(Fs, Peers)), direct(Os), G);
digest(#g{peers = Peers, followers = Fs, origins = Os, fanout = K, rand = R0} = G) ->
    {Random, R} = pick(K, maps:keys(Peers), R0, []),
    Relays = [V || {_, {_, _, V}} <- maps:to_list(Os), V =/= direct, is_map_key(V, Peers)],
    To = lists:usort(Random ++ Relays ++ maps:keys(Fs)),
    send_digest(digest, To, direct(Os), G#g{rand = R}).

%% A member's digest gets ours back (a follower sends none; with fanout
%% `all' every member gets ours anyway).
answer(_Node, #g{hidden = true} = G) ->
    G;
answer(_Node, #g{fanout = all} = G) ->
    G;
answer(Node, #g{origins = Os} = G) ->
    send_digest(digest_back, [Node], direct(Os), G).

%% By name: the receiver may know no atom for some of them.
direct(Os) ->
    [{atom_to_binary(O, utf8), I, V} || {O, {I, V, direct}} <- maps:to_list(Os)].

send_digest(Tag, Nodes, Direct, #g{peers = Peers, followers = Fs, inc = Inc, ver = Ver} = G) ->
    lists:foldl(fun(Node, S) ->
                        #peer{out = Out} = case maps:find(Node, Peers) of
                                               {ok, P} -> P;
                                               error -> maps:get(Node, Fs)
                                           end,
                        Name = atom_to_binary(Node, utf8),
                        chan_out(Out, {Tag, Inc, Ver, [D || {O, _, _} = D <- Direct, O =/= Name]}, S)
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

%% Gossip taken in: the other receptionists' messages (ap_rcpt2*, and the
%% older protocol's); whole states (a member's, or an origin's through a
%% relay) also as full syncs.
count_in(Msg, #g{received = N, received_bytes = B, full_syncs = F} = G)
  when is_tuple(Msg), tuple_size(Msg) >= 2 ->
    Full = case Msg of
               {ap_rcpt2, _, Body} when is_tuple(Body), tuple_size(Body) > 0 ->
                   element(1, Body) =:= state orelse element(1, Body) =:= origin_state;
               _ ->
                   false
           end,
    case element(1, Msg) of
        Tag when Tag =:= ap_rcpt2; Tag =:= ap_rcpt2_hello ->
            G#g{received = N + 1, received_bytes = B + erlang:external_size(Msg),
                full_syncs = F + case Full of true -> 1; false -> 0 end};
        Tag when is_atom(Tag) ->
            case lists:member(Tag, ?OLD_TAGS) of
                true -> G#g{received = N + 1, received_bytes = B + erlang:external_size(Msg)};
                false -> G
            end;
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
    #{node => node(),
      hidden => init:get_argument(hidden) =/= error,
      send => fun(Dest, Msg) -> erlang:send(Dest, Msg, [noconnect, nosuspend]) end,
      %% The alias lives as long as the monitor: a DOWN, or demonitor/2,
      %% deactivates it, and what the other side still sends there is
      %% dropped by the runtime.
      monitor => fun(Target) -> erlang:monitor(process, Target, [{alias, demonitor}]) end,
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

%% Nodes we wait for to answer as members: for three rounds (a
%% follower's channel being opened is not waited for).
member_probes(#g{probing = Pr}) ->
    [N || {N, #probe{rel = member, rounds = R}} <- maps:to_list(Pr), R > 0].

complete(#g{peers = Peers} = G) ->
    member_probes(G) =:= [] andalso
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
