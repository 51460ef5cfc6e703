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
%%
%% <h3>Where the parts are</h3>
%% This module has the API and what each message does; the view (members,
%% followers, channels, origins, completeness) is in
%% `actor_receptionist_gossip_view', and what goes out (deltas, states,
%% digests, the counts, the outside world) in
%% `actor_receptionist_gossip_out'. They share the state's records
%% (`actor_receptionist_gossip.hrl') and are called only from here, in
%% the server's process.
-module(actor_receptionist_gossip).

-include("actor_pool_int.hrl").
-include("actor_receptionist_int.hrl").
-include("actor_receptionist_gossip.hrl").

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

-import(actor_receptionist_gossip_view,
        [probe/3, close/2, in_of/2, link_of/3, down/3, reprobe/1, hello/2, candidates/2,
         forget_probe/2, forget_follower/2, missing/3, want/3, ask/2, member_left/2,
         effect/2, existing/1, ours/2, relayed/3, replace_origin/6, to_node/1,
         complete/1, member_probes/1, release/1]).
-import(actor_receptionist_gossip_out,
        [chan_out/3, send_deltas/5, send_state/3, digest/1, answer/2, out/3, count_in/2,
         real_io/0, io_nodes/2, io_timer/3]).

-export_type([state/0, effect/0, status/0, env/0, io/0, op/0]).

-type status() :: #{complete := boolean(),
                    members := [node()],
                    syncing := [node()],
                    origins := #{node() => {non_neg_integer(), non_neg_integer()}},
                    incarnation := non_neg_integer(),
                    version := non_neg_integer(),
                    gossip := #{sent | sent_bytes | received | received_bytes | full_syncs
                                | member_drops | rejected => non_neg_integer()}}.

-type op() :: {reg | dereg, binary(), pid()}.
%% A local change, as a delta carries it.

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

%% Bytes of a node name (255 characters of UTF-8).
-define(MAX_NODE_BYTES, 1020).
-define(IS_NAME(B), (is_binary(B) andalso byte_size(B) > 0 andalso byte_size(B) =< ?MAX_NODE_BYTES)).
-define(IS_VER(X), (is_integer(X) andalso X >= 0)).

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
%% @doc Count Msg as gossip sent (the server sends origin states itself).
-spec sent(term(), state()) -> state().
sent(Msg, G) ->
    actor_receptionist_gossip_out:sent(Msg, G).

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
