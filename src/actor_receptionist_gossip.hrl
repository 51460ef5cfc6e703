%% The state of actor_receptionist_gossip, which its parts share
%% (actor_receptionist_gossip_view, actor_receptionist_gossip_out): a
%% member's or follower's channel (peer), a channel being opened (probe),
%% and the whole (g). Private to them.

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
    io :: actor_receptionist_gossip:io(),
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
    pending = [] :: [actor_receptionist_gossip:op()],
    %% subscriptions held until the view is complete, oldest first
    waiting = [] :: [{binary(), pid()}],
    %% what the caller of handle/2 must do, newest first
    effects = [] :: [actor_receptionist_gossip:effect()],
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
