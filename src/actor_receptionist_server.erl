%% Over 700 lines, kept whole: one gen_server whose every message changes the
%% journal, the C node's batch and the gossip state in one step (see below);
%% the journal, the members' registrations and the cluster's rules are
%% modules of their own.

%% @doc The BEAM-side front of this node's receptionist C node.
%%
%% Why a front at all: a C node cannot monitor a BEAM process, must never be
%% linked to one, and loses its state when it dies. So this server
%% <ul>
%% <li>keeps the journal of this node's registrations and subscriptions
%%     ({@link actor_receptionist_journal}: ETS tables owned by {@link
%%     actor_receptionist_sup}, so they survive a crash of this server) and
%%     replays it, with what it holds of the other members ({@link
%%     actor_receptionist_remote}), into every new incarnation of the C
%%     node, before the NIF is pointed at the new snapshot: lookups go on
%%     answering from the old snapshot meanwhile;</li>
%% <li>monitors subscribers and tells the C node when one dies;</li>
%% <li>monitors the refs of watched registrations (`register/4' with
%%     `watch', `{via, actor_receptionist, Name}' names) and deregisters
%%     them when they die, which replicates as any deregistration does;
%%     the watches are in the journal, so a restarted server monitors them
%%     again (a ref that died meanwhile is reported at once);</li>
%% <li>answers `register_name' (a `via' name) from what it holds, so that
%%     one member never gives one name twice, and replies once the C node
%%     has the registration in its snapshot;</li>
%% <li>enforces the subscriber limits (every local subscription passes
%%     here, so the counts are exact) and sends the rejections;</li>
%% <li>forwards everything else to the C node in arrival order, coalescing
%%     what arrives in a burst into one `{batch, Msgs}' message, and queues
%%     it while the C node is down.</li>
%% </ul>
%% Every incarnation is addressed by the pid of its registry process, so a
%% message meant for an earlier incarnation is dropped by the runtime instead
%% of landing in the next one ahead of the replay. Replies (acknowledgements,
%% find listings, rejections) are kept until the C node confirms, in the same
%% batch, that it has sent them; those of an incarnation that died first are
%% sent again by the next one (so a reply may come twice, never not at all).
%% A lost connection to a live incarnation (nodedown) makes the server
%% restart it, since what was in flight is unknown; and a server that
%% restarts while its C node is up does the same, since the C node may hold
%% changes the journal no longer has.
%% The cluster's rules are {@link actor_receptionist_gossip}, run in this
%% process. The protocol to the C node is in docs/receptionist.md
%% ("Internals").
-module(actor_receptionist_server).
-behaviour(gen_server).

-include("actor_pool_int.hrl").
-include("actor_receptionist_int.hrl").

%% API.
-export([start_link/1]).
-export([shm_name/1]).

%% gen_server callbacks.
-export([init/1]).
-export([handle_call/3]).
-export([handle_cast/2]).
-export([handle_info/2]).
-export([terminate/2]).

-export_type([opts/0]).

-type opts() :: #{owner := atom() | pid(),
                  max_subscribers_per_key := non_neg_integer(),
                  max_subscribers_total := non_neg_integer(),
                  gossip_interval_ms := pos_integer(),
                  gossip_fanout := pos_integer()}.

%% Messages per {batch, Msgs} to the C node; a batch's bytes (external
%% size) stay under the C node's max_frame less the envelope (a frame over
%% it is dropped whole, and with it registrations nobody would send again).
-define(MAX_BATCH, 1024).
%% How long a replay may take before the incarnation is given up on.
-define(SYNC_TIMEOUT, 15000).

-record(state, {
    rcpt :: node(),
    owner :: atom() | pid(),
    %% the registry process of the current incarnation
    pid :: pid() | undefined,
    %% replies sent but not yet confirmed: [{Seq, [Msg]}], oldest first
    unconfirmed = [] :: [{non_neg_integer(), [term()]}],
    seq = 0 :: non_neg_integer(),
    per_key :: non_neg_integer(),
    total_limit :: non_neg_integer(),
    %% the C node is up and has had the journal replayed
    up = false :: boolean(),
    %% messages not yet sent to the C node, newest first
    out = [] :: [term()],
    out_len = 0 :: non_neg_integer(),
    %% a flush message is on its way to us
    flushing = false :: boolean(),
    %% live subscriptions per key id, and in all
    counts = #{} :: #{binary() => pos_integer()},
    total = 0 :: non_neg_integer(),
    %% one monitor per subscriber pid
    monitors = #{} :: #{pid() => reference()},
    %% one monitor per watched ref
    watches = #{} :: #{pid() => reference()},
    %% register_name and unregister_name calls waiting for the C node
    named = #{} :: #{pos_integer() => {gen_server:from(), yes | ok}},
    incarnations = 0 :: non_neg_integer(),
    %% the cluster half (membership, versions, deltas)
    gossip :: actor_receptionist_gossip:state(),
    %% what we hold of each other member
    remote :: actor_receptionist_remote:state(),
    %% a hidden node: its registrations are also made on the members it
    %% follows
    follower = false :: boolean(),
    %% bytes a {batch, Msgs} to the C node may hold
    batch_bytes :: pos_integer()
}).

%% ===================================================================
%% API
%% ===================================================================

%% @doc Starts the server, registered as `actor_receptionist_server'.
-spec start_link(opts()) -> {ok, pid()} | {error, term()}.
start_link(Opts) ->
    gen_server:start_link({local, ?RCPT_SERVER}, ?MODULE, Opts, []).

%% @doc The POSIX shared-memory name of the snapshot of receptionist node
%% `Node' (the C node's default for `--shm').
-spec shm_name(node()) -> string().
shm_name(Node) ->
    actor_cnode:shm_name(Node).

%% ===================================================================
%% gen_server callbacks
%% ===================================================================

-spec init(opts()) -> {ok, #state{}} | {stop, no_receptionist_node}.
init(#{owner := Owner, max_subscribers_per_key := PerKey,
       max_subscribers_total := Total, gossip_interval_ms := Interval,
       gossip_fanout := Fanout}) ->
    %% Recorded by actor_receptionist_sup when it started the owner.
    Node = actor_receptionist:receptionist_node(),
    init(Node, Owner, PerKey, Total, {Interval, Fanout}).

init(undefined, _Owner, _PerKey, _Total, _Gossip) ->
    {stop, no_receptionist_node};
init(Node, Owner, PerKey, Total, {Interval, Fanout}) ->
    %% Ours, rebuilt at each start: what we hold of the other members
    %% (nothing yet) and the journal's index of refs by node.
    Remote = actor_receptionist_remote:new(),
    ok = actor_receptionist_journal:index(),
    %% A new incarnation for the other members: they send us their
    %% registrations again, and take ours from our journal.
    G = actor_receptionist_gossip:new(Interval, own_cnodes(Node), Fanout),
    State0 = #state{rcpt = Node, owner = Owner, per_key = PerKey, total_limit = Total,
                    gossip = G, remote = Remote, follower = actor_receptionist_gossip:hidden(G),
                    batch_bytes = batch_bytes(Owner)},
    %% A restarted server takes the subscriptions over from the journal; a
    %% subscriber that died meanwhile is reported at once (noproc).
    State1 = lists:foldl(fun({Pid, Id}, S) -> count_sub(Pid, Id, S) end, State0,
                         actor_receptionist_journal:subs()),
    %% It takes the watches over too; a ref that died meanwhile is reported
    %% at once (noproc) and deregistered.
    State = State1#state{watches = maps:from_list(
                                     [{Ref, erlang:monitor(process, Ref)}
                                      || Ref <- actor_receptionist_journal:prune_watched()])},
    %% The owner notifies us of each new incarnation; the current one may
    %% have come up before we were registered. If it has served requests
    %% already, this server is a restarted one: the C node may hold changes
    %% that were applied to the journal but never sent (or the reverse), so
    %% it is restarted and gets the journal from scratch.
    case catch actor_cnode:info(Owner) of
        #{status := up} ->
            case fresh(Node) of
                true ->
                    {ok, replay(State)};
                false ->
                    logger:notice("actor_receptionist: server restarted; restarting ~ts "
                                  "to replay the journal into a clean registry", [Node]),
                    ok = actor_cnode:restart(Owner),
                    {ok, State}
            end;
        _ ->
            {ok, State}
    end.

-spec handle_call(term(), gen_server:from(), #state{}) ->
          {reply, term(), #state{}} | {noreply, #state{}}.
handle_call(stats, _From, State) ->
    Own = #{status => case State#state.up of true -> up; false -> down end,
            local_registrations => actor_receptionist_journal:regs_count(),
            watched_registrations => actor_receptionist_journal:watched_count(),
            local_subscriptions => State#state.total,
            incarnations => State#state.incarnations,
            queued => State#state.out_len},
    Remote = case State#state.up of
                 true ->
                     try gen_server:call({?RCPT_PROC, State#state.rcpt}, stats, 5000) of
                         #{} = M -> M;
                         _ -> #{}
                     catch
                         exit:_ -> #{}
                     end;
                 false ->
                     #{}
             end,
    {reply, maps:merge(Remote, Own), State};
handle_call(status, _From, #state{gossip = G} = State) ->
    {reply, actor_receptionist_gossip:status(G), State};
handle_call(gossip_bytes, _From, #state{gossip = G} = State) ->
    {reply, actor_receptionist_gossip:bytes(G), State};
handle_call(sync, _From, State0) ->
    %% Tests and benchmarks: everything sent before has been applied.
    State = flush(State0),
    Reply = case State#state.up of
                true -> call_rcpt(sync, State);
                false -> {error, down}
            end,
    {reply, Reply, State};
handle_call({register_name, Id, Pid}, From, State) when ?IS_ID(Id), is_pid(Pid) ->
    %% A name is taken while a ref is registered under its key, by this
    %% node or another member as far as we know, unless it is a process of
    %% this node that is dead (as whereis_name/1 has it): a watched one's
    %% DOWN may still be on its way to us while the supervisor that got its
    %% EXIT starts the next one.
    Holders = actor_receptionist_journal:refs(Id) ++
        actor_receptionist_remote:refs(Id, State#state.remote),
    case [H || H <- Holders, node(H) =/= node() orelse is_process_alive(H)] of
        [] -> {noreply, named(From, yes, apply_op({register_watched, Id, Pid, undefined}, State))};
        _ -> {reply, no, State}
    end;
handle_call({unregister_name, Id}, From, State0) when ?IS_ID(Id) ->
    %% This node's watched registrations under the key; another member's
    %% are its own to remove.
    State = lists:foldl(fun(Ref, S) -> apply_op({deregister, Id, Ref, undefined}, S) end, State0,
                        [Ref || Ref <- actor_receptionist_journal:refs(Id),
                                actor_receptionist_journal:watched(Ref, Id)]),
    {noreply, named(From, ok, State)};
handle_call(Request, _From, State) ->
    {reply, {error, {unknown_call, Request}}, State}.

%% Reply to a register_name or unregister_name once the C node has applied
%% what came before: its confirmation comes after its snapshot write, so a
%% whereis_name/1 (a lookup) right after the reply sees the change. Through
%% the C node like any reply, so it is sent again after a replay if that
%% incarnation died first (a second one finds no caller and is dropped).
named(From, Reply, #state{named = Named} = State) ->
    N = erlang:unique_integer([positive]),
    out({send, self(), {rcpt_named, N}}, State#state{named = Named#{N => {From, Reply}}}).

-spec handle_cast(term(), #state{}) -> {noreply, #state{}}.
handle_cast(Msg, State) ->
    {noreply, flush_if_idle(apply_op(Msg, State))}.

%% A lone request (nothing else waiting but our own flush message) goes out
%% now rather than one loop later: the batching is for bursts.
flush_if_idle(#state{flushing = true} = State) ->
    case process_info(self(), message_queue_len) of
        {message_queue_len, N} when N =< 1 -> flush_all(State);
        _ -> State
    end;
flush_if_idle(State) ->
    State.

%% One request: a caller's (casts), or one this server makes itself (a
%% follower's registration, a subscription held for a complete view, the
%% registrations of a node that left). Every request
%% goes through here once; the change itself, the same on a member and a
%% follower, is record_op/2's.
%%
%% On a hidden node (a follower) a registration is recorded here as usual
%% (journal, C node: this node's own lookups see it at once) and also made
%% on every member it follows, so the cluster has it; each member holds it
%% for as long as this node's connection to it lasts, and gets the whole
%% journal again whenever it (re)syncs with this node. A member takes a
%% follower's registrations over its channel with that follower only (the
%% gossip core's `followed' effects).
apply_op({Op, Id, Ref, _ReplyTo} = Msg, #state{follower = true} = State)
  when (Op =:= register orelse Op =:= deregister), is_binary(Id), is_pid(Ref) ->
    #state{gossip = G} = State1 = record_op(Msg, State),
    State1#state{gossip = actor_receptionist_gossip:forward(Op, Id, Ref, G)};
apply_op({Op, _Id, _Ref, _ReplyTo} = Msg, State) when Op =:= register; Op =:= deregister ->
    record_op(Msg, State);
apply_op({register_watched, Id, Ref, ReplyTo}, State) when ?IS_ID(Id), is_pid(Ref) ->
    %% Registered as any other, then watched: from the first register that
    %% asks, until deregister or death.
    State1 = apply_op({register, Id, Ref, ReplyTo}, State),
    case actor_receptionist_journal:registered(Id, Ref) of
        true -> watch(Id, Ref, State1);
        false -> State1
    end;
apply_op({subscribe_when_complete, Id, Pid}, #state{gossip = G} = State) ->
    case actor_receptionist_gossip:hold(Id, Pid, G) of
        {true, G1} -> apply_op({subscribe, Id, Pid}, State#state{gossip = G1});
        {false, G1} -> State#state{gossip = G1}
    end;
apply_op({find, _Id, _ReplyTo} = Msg, State) ->
    out(Msg, State);
apply_op({subscribe, Id, Pid} = Msg, State) ->
    case actor_receptionist_journal:subscribed(Pid, Id) of
        true ->
            %% One subscription; the C node sends a fresh listing.
            out(Msg, State);
        false ->
            case limit(Id, State) of
                ok ->
                    ok = actor_receptionist_journal:add_sub(Pid, Id),
                    out(Msg, count_sub(Pid, Id, State));
                {Reason, Limit} ->
                    %% Through the C node, so that it reaches the subscriber
                    %% in order with the listings of its earlier requests.
                    Rejected = {receptionist_subscribe_rejected, {service_key, Id}, Reason, Limit},
                    out({send, Pid, Rejected}, State)
            end
    end;
apply_op({unsubscribe, Id, Pid} = Msg, #state{gossip = G} = State0) ->
    %% Also a subscription still held for a complete view.
    State = State0#state{gossip = actor_receptionist_gossip:cancel(Id, Pid, G)},
    case actor_receptionist_journal:subscribed(Pid, Id) of
        true ->
            ok = actor_receptionist_journal:del_sub(Pid, Id),
            out(Msg, uncount_sub(Pid, Id, State));
        false ->
            State
    end;
apply_op(Msg, State) ->
    unexpected(Msg, State).

%% A registration or deregistration of this node: the journal, the other
%% members (gossip) and the C node.
%%
%% A ReplyTo on another node (a standalone pool node registering its pools)
%% cannot be reached by the C node, which talks to this node only: it gets
%% its acknowledgement from here, once the journal has the change.
record_op({Op, Id, Ref, ReplyTo}, State) when is_pid(ReplyTo), node(ReplyTo) =/= node() ->
    %% A lone change goes to the C node before its acknowledgement leaves.
    State1 = flush_if_idle(record_op({Op, Id, Ref, undefined}, State)),
    Ack = case Op of register -> registered; deregister -> deregistered end,
    _ = ?IS_ID(Id) andalso is_pid(Ref)
        andalso erlang:send(ReplyTo, {Ack, {service_key, Id}, Ref}, [noconnect, nosuspend]),
    State1;
%% Also sent by standalone pool nodes (--pool ...:key=Id): checked here too.
record_op({register, Id, Ref, ReplyTo} = Msg, State)
  when ?IS_ID(Id), is_pid(Ref), (is_pid(ReplyTo) orelse ReplyTo =:= undefined) ->
    case actor_receptionist_journal:registered(Id, Ref) of
        true ->
            out(Msg, State);
        false ->
            ok = actor_receptionist_journal:add(Id, Ref),
            ok = actor_receptionist_remote:local_added(Id, Ref, State#state.remote),
            out(Msg, gossip(reg, Id, Ref, State))
    end;
record_op({deregister, Id, Ref, ReplyTo} = Msg, State)
  when ?IS_ID(Id), is_pid(Ref), (is_pid(ReplyTo) orelse ReplyTo =:= undefined) ->
    Ack = [{send, ReplyTo, {deregistered, {service_key, Id}, Ref}} || is_pid(ReplyTo)],
    case actor_receptionist_journal:registered(Id, Ref) of
        true ->
            ok = actor_receptionist_journal:del(Id, Ref),
            State1 = gossip(dereg, Id, Ref, unwatch(Id, Ref, State)),
            case actor_receptionist_remote:let_go(Id, Ref, State1#state.remote) of
                remove -> out(Msg, State1);
                {keep, Retag} -> lists:foldl(fun out/2, State1, [Retag | Ack])
            end;
        false ->
            %% Not ours: nothing to remove (a member may hold the same ref
            %% under the same key, and keeps it). The reply still goes
            %% through the C node, in order with its listings.
            lists:foldl(fun out/2, State, Ack)
    end;
record_op(Msg, State) ->
    unexpected(Msg, State).

unexpected(Msg, State) ->
    logger:warning("actor_receptionist_server: unexpected cast ~0p", [Msg]),
    State.

-spec handle_info(term(), #state{}) -> {noreply, #state{}}.
handle_info(flush, State) ->
    {noreply, flush_all(State#state{flushing = false})};
handle_info({rcpt_confirmed, Seq}, #state{unconfirmed = Un} = State) ->
    {noreply, State#state{unconfirmed = [E || {S, _} = E <- Un, S > Seq]}};
handle_info({nodedown, Node}, #state{rcpt = Node, up = true, owner = Owner} = State) ->
    logger:warning("actor_receptionist: connection to ~ts lost; restarting it", [Node]),
    ok = actor_cnode:restart(Owner),
    {noreply, State#state{up = false, pid = undefined}};
handle_info({nodedown, _Node}, State) ->
    {noreply, State};
handle_info({'DOWN', Mref, process, Pid, _} = Msg,
            #state{monitors = Mons, watches = Watches} = State0) ->
    case {maps:find(Pid, Mons), maps:find(Pid, Watches)} of
        {{ok, Mref}, _} ->
            Ids = actor_receptionist_journal:subs_of(Pid),
            ok = actor_receptionist_journal:del_subs_of(Pid),
            State1 = lists:foldl(fun(Id, S) -> uncount(Id, S) end, State0, Ids),
            State = State1#state{monitors = maps:remove(Pid, Mons)},
            {noreply, out({unsubscribe_all, Pid}, State)};
        {_, {ok, Mref}} ->
            %% A watched ref died (or its node went: noconnection).
            {noreply, watched_down(Pid, State0)};
        _ ->
            cluster(Msg, State0)
    end;
handle_info({rcpt_named, N}, #state{named = Named} = State) ->
    case maps:take(N, Named) of
        {{From, Reply}, Named1} ->
            gen_server:reply(From, Reply),
            {noreply, State#state{named = Named1}};
        error ->
            {noreply, State}
    end;
handle_info({actor_cnode, _Owner, Node, up}, #state{rcpt = Node, up = true, pid = Pid} = State) ->
    %% Seen already (init/1 replayed into it) unless the pid changed.
    case call_rcpt(pid, State) of
        Pid -> {noreply, State};
        _ -> {noreply, replay(State#state{up = false})}
    end;
handle_info({actor_cnode, _Owner, Node, up}, #state{rcpt = Node} = State) ->
    {noreply, replay(State)};
handle_info({actor_cnode, _Owner, Node, down}, #state{rcpt = Node} = State) ->
    logger:warning("actor_receptionist: receptionist node ~ts is down; "
                   "requests are queued until it is back", [Node]),
    monitor_off(Node),
    {noreply, State#state{up = false, pid = undefined}};
handle_info(Msg, State) ->
    cluster(Msg, State).

%% A message of the cluster half: its effects are applied at once and sent
%% to the C node without waiting for a flush round (a delta is a batch
%% already).
cluster(Msg, #state{rcpt = Node, gossip = G, remote = R} = State00) ->
    State0 = case Msg of
                 {actor_receptionist_gossip, tick} ->
                     State00#state{remote = actor_receptionist_remote:reap(R)};
                 _ ->
                     State00
             end,
    Env = #{journal => fun actor_receptionist_journal:regs/0, cnodes => own_cnodes(Node)},
    case actor_receptionist_gossip:handle(Msg, Env, G) of
        {ok, G1, Effects} ->
            State = lists:foldl(fun effect/2, State0#state{gossip = G1}, Effects),
            {noreply, flush(State)};
        ignore ->
            logger:warning("actor_receptionist_server: unexpected message ~0p", [Msg]),
            {noreply, State0}
    end.

%% This BEAM's own C nodes (its receptionist's and its pool node): they
%% connect to it hidden and run no receptionist server, so they are never
%% probed.
own_cnodes(Rcpt) ->
    [N || N <- [Rcpt, actor_pool:pool_node()], N =/= undefined].

effect({remote, Origin, Ops}, #state{remote = R} = State) ->
    remote(actor_receptionist_remote:ops(Origin, Ops, R), State);
effect({replace_origin, Origin, Regs}, #state{remote = R} = State) ->
    remote(actor_receptionist_remote:replace(Origin, Regs, R), State);
effect({drop_origin, Origin}, #state{remote = R} = State) ->
    case actor_receptionist_remote:drop(Origin, R) of
        {_, []} ->
            State;
        Dropped ->
            %% At once: the C node drops the member in one step.
            flush(remote(Dropped, State))
    end;
effect({origin_state, To, Origin, Inc, Ver}, #state{remote = R, gossip = G} = State) ->
    %% A member or follower has Origin relayed through us: the rows,
    %% exactly version Ver (applied in this process as they came).
    Regs = actor_receptionist_remote:rows(Origin, R),
    Msg = actor_receptionist_gossip:origin_state(To, Origin, Inc, Ver, Regs),
    case erlang:send(To, Msg, [noconnect, nosuspend]) of
        ok -> State#state{gossip = actor_receptionist_gossip:sent(Msg, G)};
        _ -> State
    end;
effect({drop_refs_on, Node}, State) ->
    %% That node is gone: our registrations of its processes end, and those
    %% a follower made through us.
    State1 = lists:foldl(fun({Id, Ref}, S) -> followed(deregister, Node, Id, Ref, S) end,
                         State, actor_receptionist_journal:followed(Node)),
    lists:foldl(fun({Id, Ref}, S) -> apply_op({deregister, Id, Ref, undefined}, S) end,
                State1, actor_receptionist_journal:refs_on(Node));
effect({followed, Follower, Op, Id, Ref}, State) ->
    %% A follower's registration: ours while its connection lasts.
    followed(Op, Follower, Id, Ref, State);
effect({followed_sync, Follower, Regs}, State) ->
    %% A follower's whole journal: what it no longer has goes.
    Old = sets:from_list(actor_receptionist_journal:followed(Follower), [{version, 2}]),
    New = sets:from_list([E || {Id, Ref} = E <- Regs, ?IS_ID(Id), is_pid(Ref)], [{version, 2}]),
    State1 = sets:fold(fun({Id, Ref}, S) -> followed(deregister, Follower, Id, Ref, S) end, State,
                       sets:subtract(Old, New)),
    sets:fold(fun({Id, Ref}, S) -> followed(register, Follower, Id, Ref, S) end, State1,
              sets:subtract(New, Old));
effect({old_protocol, Node}, State) ->
    logger:notice("actor_receptionist: gossip of an older version, naming the receptionist "
                  "of ~ts, dropped: receptionists of different versions share no "
                  "registrations (said once per node)", [Node]),
    State;
effect({subscribe, Id, Pid}, State) ->
    apply_op({subscribe, Id, Pid}, State).

-spec terminate(term(), #state{}) -> ok.
terminate(Reason, _State) when Reason =:= normal; Reason =:= shutdown ->
    %% The application stops: lookups must not answer from a dead snapshot.
    _ = (catch actor_nif:detach()),
    ok;
terminate(_Reason, _State) ->
    %% A crash: the supervisor restarts us, the snapshot is still current.
    ok.

%% ===================================================================
%% Internals
%% ===================================================================

%% A change of what we hold of the other members, and its messages for the
%% C node.
remote({R, Msgs}, State) ->
    lists:foldl(fun out/2, State#state{remote = R}, Msgs).

%% A follower's registration, held in our journal and indexed by follower.
followed(register, Follower, Id, Ref, State) ->
    ok = actor_receptionist_journal:add_followed(Follower, Id, Ref),
    apply_op({register, Id, Ref, undefined}, State);
followed(deregister, Follower, Id, Ref, State) ->
    ok = actor_receptionist_journal:del_followed(Follower, Id, Ref),
    apply_op({deregister, Id, Ref, undefined}, State).

%% A change of the journal, for the other members: it goes with the next
%% flush, which is on its way even while the C node is down.
gossip(Op, Id, Ref, #state{gossip = G} = State) ->
    schedule_flush(State#state{gossip = actor_receptionist_gossip:local(Op, Id, Ref, G)}).

%% Watch Ref (registered under Id): one monitor per ref, however many keys.
watch(Id, Ref, #state{watches = Watches} = State) ->
    ok = actor_receptionist_journal:watch(Ref, Id),
    case maps:is_key(Ref, Watches) of
        true -> State;
        false -> State#state{watches = Watches#{Ref => erlang:monitor(process, Ref)}}
    end.

%% Ref's registration under Id goes: so does its watch, and the monitor
%% with the last one.
unwatch(Id, Ref, #state{watches = Watches} = State) ->
    case maps:find(Ref, Watches) of
        error ->
            State;
        {ok, Mref} ->
            ok = actor_receptionist_journal:unwatch(Ref, Id),
            case actor_receptionist_journal:is_watched(Ref) of
                true ->
                    State;
                false ->
                    true = erlang:demonitor(Mref, [flush]),
                    State#state{watches = maps:remove(Ref, Watches)}
            end
    end.

%% A watched ref is dead: every watched registration of it is deregistered
%% (and replicated), as if it had asked.
watched_down(Ref, #state{watches = Watches} = State) ->
    Ids = actor_receptionist_journal:watched_ids(Ref),
    ok = actor_receptionist_journal:unwatch_all(Ref),
    lists:foldl(fun(Id, S) -> apply_op({deregister, Id, Ref, undefined}, S) end,
                State#state{watches = maps:remove(Ref, Watches)}, Ids).

limit(Id, #state{counts = Counts, per_key = PerKey, total = Total, total_limit = TotalLimit}) ->
    case maps:get(Id, Counts, 0) >= PerKey of
        true -> {max_subscribers_per_key, PerKey};
        false when Total >= TotalLimit -> {max_subscribers_total, TotalLimit};
        false -> ok
    end.

count_sub(Pid, Id, #state{counts = Counts, total = Total, monitors = Mons} = State) ->
    Mons1 = case maps:is_key(Pid, Mons) of
                true -> Mons;
                false -> Mons#{Pid => erlang:monitor(process, Pid)}
            end,
    State#state{counts = maps:update_with(Id, fun(N) -> N + 1 end, 1, Counts),
                total = Total + 1, monitors = Mons1}.

uncount_sub(Pid, Id, State0) ->
    State = uncount(Id, State0),
    case actor_receptionist_journal:has_subs(Pid) of
        true ->
            State;
        false ->
            {Mref, Mons} = maps:take(Pid, State#state.monitors),
            true = erlang:demonitor(Mref, [flush]),
            State#state{monitors = Mons}
    end.

uncount(Id, #state{counts = Counts, total = Total} = State) ->
    Counts1 = case maps:get(Id, Counts) of
                  1 -> maps:remove(Id, Counts);
                  N -> Counts#{Id := N - 1}
              end,
    State#state{counts = Counts1, total = Total - 1}.

%% Queue Msg for the C node; the first message of a burst asks for a flush,
%% which arrives after everything already in our mailbox: one batch per
%% burst, and a lone message waits for one self-message only.
out(Msg, #state{out = Out, out_len = Len} = State) ->
    State1 = State#state{out = [Msg | Out], out_len = Len + 1},
    case State1#state.up of
        true -> schedule_flush(State1);
        false -> State1
    end.

schedule_flush(#state{flushing = true} = State) ->
    State;
schedule_flush(State) ->
    self() ! flush,
    State#state{flushing = true}.

%% The C node's batch and the members' delta.
flush_all(#state{gossip = G} = State) ->
    flush(State#state{gossip = actor_receptionist_gossip:flush(G)}).

flush(#state{up = false} = State) ->
    State;
flush(#state{out = []} = State) ->
    State;
flush(#state{out = Out, seq = Seq0, unconfirmed = Un} = State) ->
    Msgs = lists:reverse(Out),
    %% Replies ride with a confirmation that the C node sends back after
    %% them: until it comes, they are owed.
    {Msgs1, State1} = case [M || M <- Msgs, replies(M)] of
                          [] ->
                              {Msgs, State};
                          Owed ->
                              Seq = Seq0 + 1,
                              {Msgs ++ [{send, self(), {rcpt_confirmed, Seq}}],
                               State#state{seq = Seq, unconfirmed = Un ++ [{Seq, Owed}]}}
                      end,
    send_all(Msgs1, State1),
    State1#state{out = [], out_len = 0}.

%% Messages whose loss someone would notice.
replies({register, _, _, ReplyTo}) -> ReplyTo =/= undefined;
replies({deregister, _, _, ReplyTo}) -> ReplyTo =/= undefined;
replies({find, _, _}) -> true;
replies({send, _, _}) -> true;
replies(_) -> false.

%% After a replay the journal already holds every state change; what is
%% left to do for a queued or unconfirmed message is its reply.
owed({register, Id, Ref, ReplyTo}) when is_pid(ReplyTo) ->
    [{send, ReplyTo, {registered, {service_key, Id}, Ref}}];
owed({deregister, Id, Ref, ReplyTo}) when is_pid(ReplyTo) ->
    [{send, ReplyTo, {deregistered, {service_key, Id}, Ref}}];
owed({find, _, _} = Find) -> [Find];
owed({send, _, _} = Send) -> [Send];
owed(_) -> [].

send_all([], _State) ->
    ok;
send_all([Msg], State) ->
    send(Msg, State);
send_all(Msgs, #state{batch_bytes = Max} = State) ->
    {Batch, Rest} = take(Msgs, ?MAX_BATCH, Max, []),
    case Batch of
        [Msg] -> send(Msg, State);
        _ -> send({batch, Batch}, State)
    end,
    send_all(Rest, State).

%% Up to N messages and Bytes bytes; at least one (a single message is
%% bounded by the key's and the reply's limits, far under any max_frame).
take(Rest, 0, _Bytes, Acc) ->
    {lists:reverse(Acc), Rest};
take([], _N, _Bytes, Acc) ->
    {lists:reverse(Acc), []};
take([M | Rest] = Msgs, N, Bytes, Acc) ->
    case erlang:external_size(M) of
        Size when Size =< Bytes; Acc =:= [] -> take(Rest, N - 1, Bytes - Size, [M | Acc]);
        _ -> {lists:reverse(Acc), Msgs}
    end.

%% The C node's max_frame (from its owner), less the frame's envelope.
batch_bytes(Owner) ->
    MaxFrame = try actor_cnode:info(Owner) of
                   #{max_frame := M} -> M
               catch
                   exit:_ -> ?MIN_MAX_FRAME
               end,
    MaxFrame - ?FRAME_ENVELOPE.

send(_Msg, #state{pid = undefined}) ->
    ok;
send(Msg, #state{pid = Pid}) ->
    _ = erlang:send(Pid, Msg, [noconnect]),
    ok.

call_rcpt(Request, #state{rcpt = Node, pid = Pid}) ->
    %% By pid once known: a call to an incarnation that is gone fails
    %% instead of reaching the next one.
    Dest = case Pid of
               undefined -> {?RCPT_PROC, Node};
               _ -> Pid
           end,
    try gen_server:call(Dest, Request, ?SYNC_TIMEOUT)
    catch
        exit:Reason -> {error, Reason}
    end.

%% A new incarnation of the C node: give it the journal (registrations,
%% then subscriptions, so every subscriber gets a current listing), wait
%% until it has applied it, then point the NIF at its snapshot, then send
%% the replies still owed (unconfirmed ones of the previous incarnation,
%% then those of requests queued meanwhile: their state changes are in the
%% journal already).
replay(#state{rcpt = Node, incarnations = N, owner = Owner} = State0) ->
    case call_rcpt(pid, State0) of
        Pid when is_pid(Pid) ->
            monitor_on(Node),
            Regs = [{register, Id, Ref, undefined}
                    || {Id, Ref} <- actor_receptionist_journal:regs()],
            Remote = actor_receptionist_remote:replay(State0#state.remote),
            Subs = [{subscribe, Id, P} || {P, Id} <- actor_receptionist_journal:subs()],
            State = State0#state{incarnations = N + 1, pid = Pid},
            send_all(Regs ++ Remote ++ Subs, State),
            case call_rcpt(sync, State) of
                ok ->
                    attach(Node),
                    logger:info("actor_receptionist: ~ts up; replayed ~b registrations and "
                                "~b subscriptions", [Node, length(Regs), length(Subs)]),
                    Owed = lists:append([owed(M) || {_, Ms} <- State#state.unconfirmed, M <- Ms]
                                        ++ [owed(M) || M <- lists:reverse(State#state.out)]),
                    flush(State#state{up = true, out = lists:reverse(Owed), out_len = length(Owed),
                                      unconfirmed = []});
                {error, Reason} ->
                    replay_failed(Reason, Owner, State)
            end;
        {error, Reason} ->
            replay_failed(Reason, Owner, State0);
        Other ->
            replay_failed({unexpected, Other}, Owner, State0)
    end.

%% Dead again (its owner tells us about the next one), or alive but not
%% answering: restart it, or the server would wait for an `up' that never
%% comes.
replay_failed(Reason, Owner, #state{rcpt = Node} = State) ->
    logger:warning("actor_receptionist: replay into ~ts failed (~0p); restarting it", [Node, Reason]),
    ok = actor_cnode:restart(Owner),
    monitor_off(Node),
    State#state{up = false, pid = undefined}.

%% A C node that has served no request since it started.
fresh(Node) ->
    try gen_server:call({?RCPT_PROC, Node}, stats, ?SYNC_TIMEOUT) of
        #{registers := 0, deregisters := 0, subscribes := 0, finds := 0, remote_ops := 0} -> true;
        _ -> false
    catch
        exit:_ -> false
    end.

monitor_on(Node) ->
    monitor_off(Node),
    _ = (catch erlang:monitor_node(Node, true)),
    ok.

monitor_off(Node) ->
    _ = (catch erlang:monitor_node(Node, false)),
    receive {nodedown, Node} -> ok after 0 -> ok end.

attach(Node) ->
    Name = list_to_binary(shm_name(Node)),
    try actor_nif:attach(Name, atom_to_binary(Node, utf8)) of
        ok ->
            ok;
        {error, Reason} ->
            logger:warning("actor_receptionist: cannot map the snapshot ~ts (~0p); "
                           "lookup/1 asks the receptionist instead", [Name, Reason])
    catch
        error:Reason ->
            logger:warning("actor_receptionist: the NIF is not loaded (~0p); "
                           "lookup/1 asks the receptionist instead", [Reason])
    end.
