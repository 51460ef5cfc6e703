%% @doc How actor_pool's messages reach a pool node: by distribution
%% (through actor_pool_batcher) or, to a pool node of this host, through the
%% shared-memory rings (actor_dp, actor_pool_dp; docs/same-host-transport.md).
%%
%% Everything one process sends to one pool node passes here, so this module
%% keeps the order across both transports: a process remembers (process
%% dictionary, ?DP_KEY) how it last sent to each pool node, and waits for the
%% pool node to have read its ring before it sends by distribution, and for
%% what it sent by distribution to be dispatched before it uses a ring again.
%% It also refuses what cannot fit in a frame of the pool node (counted in
%% actor_pool:oversized/0) before anything is sent.
-module(actor_pool_transport).

-include("actor_pool_int.hrl").

-export([tell/4]).
-export([ask/5]).
-export([stats/3]).
-export([call/4]).
-export([node_stats/2]).

-export_type([dest/0]).

-type dest() :: pid() | {atom(), node()}.
%% A pool (or a manager) as its pool node is asked for it: a pid, or a
%% registered name on that node.

%% Learning another pool node's max_frame holds up one large message.
-define(LEARN_TIMEOUT, 1000).

%% @doc A tell: by ring when this process may use a lane to `Node' (see
%% actor_pool_dp:lane/2), else by distribution. `Est' is
%% actor_pool_opts:sendable/1's bound of the message's size.
-spec tell(node(), dest(), term(), non_neg_integer()) -> ok.
tell(Node, Dest, Msg, Est) ->
    case actor_pool_dp:lane(Node, Dest) of
        {lane, Seg} -> ring_tell(Seg, Node, Dest, Msg, Est);
        none -> dist_tell(Node, Dest, Msg, Est)
    end.

%% @doc An ask, by ring or by distribution as {@link tell/4} chooses; the
%% reply as actor_pool:ask/3 documents it.
-spec ask(node(), dest(), term(), non_neg_integer(), timeout()) -> term().
ask(Node, Dest, Msg, Est, Timeout) ->
    case actor_pool_dp:lane(Node, Dest) of
        {lane, Seg} -> ring_request(Seg, Node, Dest, ask, {Msg, Est}, Timeout);
        none -> dist_ask(Node, Dest, Msg, Est, Timeout)
    end.

%% @doc A pool's stats request, by ring or by distribution; the reply as
%% the pool sent it, or {error, Reason}.
-spec stats(node(), dest(), timeout()) -> term().
stats(Node, Dest, Timeout) ->
    case actor_pool_dp:lane(Node, Dest) of
        {lane, Seg} -> ring_request(Seg, Node, Dest, stats, {undefined, 0}, Timeout);
        none -> call(Node, Dest, '$ap_stats', Timeout)
    end.

%% @doc The manager's `node_stats' answer (actor_pool:node_stats/1), within
%% `Timeout'.
-spec node_stats(node(), timeout()) -> #{atom() => term()} | {error, term()}.
node_stats(PoolNode, Timeout) ->
    case call(PoolNode, {?MANAGER, PoolNode}, node_stats, Timeout) of
        #{} = Stats -> Stats;
        {error, _} = Error -> Error;
        Other -> {error, {unexpected_reply, Other}}
    end.

%% A tell by distribution, unless the message does not fit in a frame of
%% the pool node: then it is dropped, counted and logged, and nothing is
%% sent.
dist_tell(Node, Dest, Msg, Est) ->
    case fits(Node, Msg, Est) of
        ok -> dist_send(Node, Dest, {tell, Msg});
        {too_large, Size, Max} -> oversized_tell(Node, Dest, Size, Max)
    end.

%% An ask by distribution, likewise: {error, {too_large, Size, Max}}.
dist_ask(Node, Dest, Msg, Est, Timeout) ->
    case fits(Node, Msg, Est) of
        ok ->
            request(Node, Dest, fun(Tag) -> {ask, self(), Tag, Msg} end, Timeout);
        {too_large, _Size, _Max} = Why ->
            count_oversized(?OVERSIZED_ASKS),
            {error, Why}
    end.

%% ok, or {too_large, Size, Max} when Msg (of external size at most Est, or
%% {exact, Size} when the ring path has encoded it) does not fit in one frame
%% of the pool node: Max is its max_frame less the frame's envelope. Nothing
%% is looked up while the size is under the floor of every max_frame; above
%% it, the pool node's max_frame (learned once from another pool node) and
%% then the exact size are taken.
fits(_Node, _Msg, {exact, Size}) when Size =< ?MIN_MAX_FRAME - ?FRAME_ENVELOPE ->
    ok;
fits(Node, _Msg, {exact, Size}) ->
    within(Size, max_frame(Node) - ?FRAME_ENVELOPE);
fits(_Node, _Msg, Est) when Est =< ?MIN_MAX_FRAME - ?FRAME_ENVELOPE ->
    ok;
fits(Node, Msg, Est) ->
    Max = max_frame(Node) - ?FRAME_ENVELOPE,
    case Est =< Max of
        true ->
            ok;
        false ->
            Size = case is_binary(Msg) of
                       true -> Est;
                       false -> erlang:external_size(Msg)
                   end,
            within(Size, Max)
    end.

within(Size, Max) when Size =< Max -> ok;
within(Size, Max) -> {too_large, Size, Max}.

%% The pool node's max_frame: this node's own pool node's is known; another
%% pool node is asked once (node_stats; kept until the application stops),
%% and one that cannot tell (an older pool node) is taken to have the
%% default. Not remembered when the pool node did not answer within a
%% second: the next large message asks again.
max_frame(Node) ->
    case actor_pool_batcher:max_frame(Node) of
        undefined ->
            case node_stats(Node, ?LEARN_TIMEOUT) of
                #{max_frame := M} when is_integer(M), M > 0 ->
                    persistent_term:put(?MAX_FRAME_KEY(Node), M),
                    M;
                {error, unknown_request} ->
                    persistent_term:put(?MAX_FRAME_KEY(Node), ?DEFAULT_MAX_FRAME),
                    ?DEFAULT_MAX_FRAME;
                _ ->
                    ?DEFAULT_MAX_FRAME
            end;
        M ->
            M
    end.

oversized_tell(Node, Dest, Size, Max) ->
    count_oversized(?OVERSIZED_TELLS),
    case persistent_term:get(?OVERSIZED, undefined) of
        {_, A} ->
            %% At most one line a second from this node; the ones passed
            %% over are counted in the next line.
            Now = erlang:monotonic_time(second),
            case atomics:exchange(A, 1, Now) of
                Now ->
                    atomics:add(A, 2, 1);
                _ ->
                    More = atomics:exchange(A, 2, 0),
                    logger:warning("actor_pool: tell to ~p on pool node ~p dropped: ~b bytes, "
                                   "at most ~b fit in a frame of it (~b more dropped since the "
                                   "last line)", [Dest, Node, Size, Max, More],
                                   #{actor_pool => oversized_tell})
            end;
        undefined ->
            ok
    end.

count_oversized(Slot) ->
    case persistent_term:get(?OVERSIZED, undefined) of
        {C, _} -> counters:add(C, Slot, 1);
        undefined -> ok
    end.

%% @doc A call to a pool or to a manager, kept in order with this process's
%% tells and asks; never batched. The reply as sent, or {error, noproc |
%% {nodedown, Node} | timeout}.
-spec call(node(), dest(), term(), timeout()) -> term().
call(Node, Dest, Request, Timeout) ->
    request(Node, Dest, fun(Tag) -> {call, self(), Tag, Request} end, Timeout).

%% As gen_server:call does it: a monitor that is also an alias, so that a
%% reply after the timeout is dropped by the runtime. A monitor on a C-node
%% process fires only when the connection goes (noconnection), or at once
%% (noproc) for a pid of an earlier incarnation of the node; a name or pid
%% the node does not know is answered {error, noproc} by the node itself.
-dialyzer({no_improper_lists, request/4}).
request(Node, Dest, MakeItem, Timeout) ->
    Mref = erlang:monitor(process, Dest, [{alias, demonitor}]),
    Tag = [alias | Mref],
    ok = dist_send(Node, Dest, MakeItem(Tag)),
    receive
        {Tag, Reply} ->
            erlang:demonitor(Mref, [flush]),
            Reply;
        {'DOWN', Mref, _, _, noproc} ->
            {error, noproc};
        {'DOWN', Mref, _, _, noconnection} ->
            {error, {nodedown, Node}};
        {'DOWN', Mref, _, _, Reason} ->
            {error, {down, Reason}}
    after Timeout ->
        erlang:demonitor(Mref, [flush]),
        %% A reply that raced the timeout is taken, not left behind.
        receive
            {Tag, Reply} -> Reply
        after 0 ->
            {error, timeout}
        end
    end.

%% ===================================================================
%% Transports: distribution and the same-host rings
%% ===================================================================

%% Process dictionary, one key: a map, per pool node, of how this process
%% last sent to it, `dist' or the ticket of its last ring submit (the ring
%% it went to; undefined for none since distribution). See
%% docs/same-host-transport.md, "Ordering". An atom key: the dictionary
%% hashes and compares an atom in one word, where a key of {Tag, Node} went
%% through make_internal_hash and eq at every get and put. A ticket changes
%% only when the process moves to another ring: the dictionary is written
%% then, not per record. No segment beside it: comparing one was a deep
%% compare (eq) on every record, and a ticket of a replaced lane only makes
%% a fence the reader meets at once (actor_dp:submit/6).
-define(DP_KEY, '$actor_pool_dp').
%% A full ring: a tell or an ask retries (yielding, then sleeping 1 ms
%% between tries, so the scheduler is never held) for this long (an ask, at
%% most its timeout), then the tell is dropped, the ask answered
%% {error, overloaded}.
%% This is the data plane's backpressure on fast senders: the pool node's
%% reader empties a ring in well under that time unless it is stuck.
-define(FULL_RETRY_US, 1000000).
-define(FULL_YIELDS, 20).
%% Switching from a ring to distribution: wait at most this long until the
%% pool node has read what this process put in the ring.
-define(DRAIN_WAIT_US, 1000000).
%% A reply the NIF committed to sending just as the ask timed out.
-define(LATE_REPLY_MS, 1000).

%% Everything sent by distribution passes here. A process whose last message
%% to Node went into a ring first waits until the pool node has read it, so
%% that this one cannot overtake it.
dist_send(Node, Dest, Item) ->
    case dp_map() of
        #{Node := dist} -> ok;
        #{Node := Ticket} = M -> ring_drained(Node, Ticket), put(?DP_KEY, M#{Node := dist});
        M -> put(?DP_KEY, M#{Node => dist})
    end,
    actor_pool_batcher:send(Node, Dest, Item).

%% Waits until the reader of the lane's segment has passed where the
%% ticket's ring ends now (actor_dp:mark/2): everything this process put
%% there. A segment that replaced the ticket's own is waited for the same
%% way, briefly; no lane (or a closed one), nothing left to read.
ring_drained(_Node, undefined) ->
    ok;
ring_drained(Node, Ticket) ->
    case actor_pool_dp:seg(Node) of
        {ok, Seg} ->
            case catch actor_dp:mark(Seg, Ticket) of
                closed -> ok;
                {'EXIT', _OtherGeometry} -> ok;
                Mark -> ring_drained(Seg, Mark, erlang:monotonic_time(microsecond) + ?DRAIN_WAIT_US, 0)
            end;
        none ->
            ok
    end.

ring_drained(Seg, Mark, Deadline, N) ->
    case catch actor_dp:consumed(Seg, Mark) of
        false ->
            case erlang:monotonic_time(microsecond) < Deadline of
                true when N < 100 ->
                    erlang:yield(),
                    ring_drained(Seg, Mark, Deadline, N + 1);
                true ->
                    %% The pool node is slow to read: stop spinning the
                    %% scheduler.
                    receive after 1 -> ok end,
                    ring_drained(Seg, Mark, Deadline, N);
                false ->
                    ok
            end;
        _TrueOrClosed ->
            ok
    end.

%% One record into the lane. Body: {term, Msg, Est} (Est: actor_pool_opts:sendable/1's
%% bound of its size), or {encoded, Bin} (Bin is term_to_binary(Msg)).
%% ok (tell) | {ok, AskId} | {ok, AskId, await} (a lone ask: worth an
%% actor_dp:await/2) | full | {encoded, Bin} (the NIF did not encode Msg,
%% too large to encode within one NIF call: here it is, encoded by
%% term_to_binary/1, which yields; submit that) | dist | {dist, Size} (use
%% distribution instead: too large for a ring, or the lane is closed; Size
%% is the message's external size once known).
ring_submit(Seg, Node, Kind, Dest, Body, Ref) ->
    case dp_map() of
        #{Node := dist} ->
            %% Everything this process sent by distribution is dispatched
            %% once a call behind it is answered.
            _ = call(Node, {?MANAGER, Node}, dp_info, ?DEFAULT_TIMEOUT),
            M = (dp_map())#{Node => undefined},
            put(?DP_KEY, M),
            ring_submit(Seg, Node, Kind, Dest, Body, Ref, undefined, M);
        #{Node := T} = M ->
            ring_submit(Seg, Node, Kind, Dest, Body, Ref, T, M);
        M ->
            ring_submit(Seg, Node, Kind, Dest, Body, Ref, undefined, M#{Node => undefined})
    end.

%% M: this process's map of ?DP_KEY as read for this record, with a key
%% for Node (one read of the dictionary per record, and a write only when
%% the ticket changed: the write replaces a value, the cheaper update of a
%% map).
ring_submit(Seg, Node, Kind, Dest, Body, Ref, Prev, M) ->
    RDest = case Dest of
                {Name, _} -> Name;
                Pid -> Pid
            end,
    try dp_submit(Seg, Kind, RDest, Body, Ref, Prev) of
        %% The same ticket as before: nothing to write. Spelt out per
        %% shape: a helper for the write took 2-8% more BEAM CPU per tell.
        {ok, Prev} -> ok;
        {ok, T1} -> put(?DP_KEY, M#{Node := T1}), ok;
        {ok, Prev, AskId} -> {ok, AskId};
        {ok, T1, AskId} -> put(?DP_KEY, M#{Node := T1}), {ok, AskId};
        {ok, Prev, AskId, await} -> {ok, AskId, await};
        {ok, T1, AskId, await} -> put(?DP_KEY, M#{Node := T1}), {ok, AskId, await};
        full -> full;
        encode -> {term, Msg, _} = Body, {encoded, term_to_binary(Msg)};
        too_large -> actor_pool_dp:count(too_large), to_dist(Body);
        closed -> actor_pool_dp:lane_closed(Node, Seg), to_dist(Body)
    catch
        %% The NIF reads pool names as Latin-1 only (the NIF interface of
        %% OTP 25): a pool named outside it is reached by distribution,
        %% after what went by ring before (the caller's "dist" path).
        error:badarg -> to_dist(Body)
    end.

dp_map() ->
    case get(?DP_KEY) of
        #{} = M -> M;
        undefined -> #{}
    end.

dp_submit(Seg, Kind, Dest, {term, Msg, Est}, Ref, Prev) ->
    actor_dp:submit(Seg, Kind, Dest, Msg, Ref, Prev, Est);
dp_submit(Seg, Kind, Dest, {encoded, Bin}, Ref, Prev) ->
    actor_dp:submit_encoded(Seg, Kind, Dest, Bin, Ref, Prev).

%% The message's external size is known once it is encoded: distribution's
%% check of it need not size it again (erlang:external_size/1 does not
%% yield).
to_dist({term, _, _}) -> dist;
to_dist({encoded, Bin}) -> {dist, byte_size(Bin)}.

ring_tell(Seg, Node, Dest, Msg, Est) ->
    case ring_submit_wait(Seg, Node, tell, Dest, {term, Msg, Est}, undefined, ?FULL_RETRY_US) of
        ok ->
            ok;
        dist ->
            %% Too large for a ring record (or the lane closed): it goes by
            %% distribution if it fits in a frame.
            dist_tell(Node, Dest, Msg, Est);
        {dist, Size} ->
            dist_tell(Node, Dest, Msg, {exact, Size});
        full ->
            %% Not to distribution: it would overtake what is in the ring.
            %% Counted (actor_pool_dp:info/0), as a full mailbox counts its
            %% dropped tells.
            actor_pool_dp:count(tell_dropped)
    end.

%% ring_submit/6, retried while the ring is full for at most WaitUs:
%% yielding first, then sleeping 1 ms between tries; and at once with the
%% message encoded when the NIF asked for it so (retries reuse the bytes).
ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs) ->
    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, undefined, 0).

ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Deadline, Tries) ->
    case ring_submit(Seg, Node, Kind, Dest, Body, Ref) of
        {encoded, _} = Encoded ->
            ring_submit_wait(Seg, Node, Kind, Dest, Encoded, Ref, WaitUs, Deadline, Tries);
        full when WaitUs > 0 ->
            Now = erlang:monotonic_time(microsecond),
            case Deadline of
                undefined ->
                    erlang:yield(),
                    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Now + WaitUs, 1);
                _ when Now < Deadline, Tries < ?FULL_YIELDS ->
                    erlang:yield(),
                    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Deadline, Tries + 1);
                _ when Now < Deadline ->
                    receive after 1 -> ok end,
                    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Deadline, Tries + 1);
                _ ->
                    full
            end;
        Other ->
            Other
    end.

%% An ask or a stats request over the lane. The reply is taken by
%% actor_dp:await/2 or comes from the NIF's reply thread as {Ref, Answer};
%% a closed lane answers every waiting ask {error, {nodedown, Node}} at once.
%% The NIF keeps the timeout ({Ref, Timeout}: it answers {error, timeout}
%% at the deadline and drops a later reply), so the wait has no timer: a
%% timer's set and cancel per ask cost 0.6 us of the BEAM's CPU under 64
%% callers (docs/same-host-transport.md, "Timeouts kept by the NIF"). Its
%% answer comes as any other: the receive waits for it with no `after'.
ring_request(Seg, Node, Dest, Kind, {Msg, Est}, Timeout) ->
    Ref = make_ref(),
    {Tag, Wait} = case Timeout of
                      T when is_integer(T), T > 0, T =< 16#FFFFFFFF -> {{Ref, T}, infinity};
                      _ -> {Ref, Timeout}
                  end,
    %% A full ring is waited for as a tell waits, within the timeout.
    WaitUs = case Timeout of
                 infinity -> ?FULL_RETRY_US;
                 _ -> min(?FULL_RETRY_US, Timeout * 1000)
             end,
    case ring_submit_wait(Seg, Node, Kind, Dest, {term, Msg, Est}, Tag, WaitUs) of
        {ok, AskId, await} when Timeout =/= 0 ->
            %% A lone asker takes its reply in the NIF (no wake-up of the
            %% reply thread, then of this scheduler); else, or late, it
            %% comes as a message.
            case actor_dp:await(Seg, AskId) of
                {reply, Reply} -> Reply;
                none -> ring_receive(Seg, AskId, Ref, Wait)
            end;
        {ok, AskId, await} ->
            ring_receive(Seg, AskId, Ref, Wait);
        {ok, AskId} ->
            ring_receive(Seg, AskId, Ref, Wait);
        full when Kind =:= ask ->
            actor_pool_dp:count(ask_full),
            {error, overloaded};
        {dist, Size} when Kind =:= ask ->
            dist_ask(Node, Dest, Msg, {exact, Size}, Timeout);
        _DistOrFullStats when Kind =:= ask ->
            dist_ask(Node, Dest, Msg, Est, Timeout);
        _DistOrFullStats ->
            call(Node, Dest, '$ap_stats', Timeout)
    end.

%% The answer as a message (Timeout infinity, also for an ask whose timeout
%% the NIF keeps: it sends exactly one message). On a timeout of the
%% caller's own the ask is cancelled in the NIF (after which no reply is
%% sent) and a reply that raced it is taken.
ring_receive(Seg, AskId, Ref, Timeout) ->
    receive
        {Ref, Reply} -> ring_answer(Seg, Reply)
    after Timeout ->
        case actor_dp:cancel(Seg, AskId) of
            true ->
                {error, timeout};
            false ->
                receive
                    {Ref, Reply} -> ring_answer(Seg, Reply)
                after ?LATE_REPLY_MS ->
                    {error, timeout}
                end
        end
    end.

%% An answer that may hold a map of more than 32 keys comes as its external
%% bytes: the NIF's reply thread cannot decode those on OTP before 27.3
%% (erlang/otp#8208), this process can. As the NIF decodes the others:
%% with no new atom, or with new ones only when the segment admits them
%% (actor_dp:admit_atoms/2, its bound on the atoms a pool node can make
%% this VM keep).
ring_answer(Seg, {'$actor_dp_ext', Bin}) ->
    case whole_term(Bin, [safe]) of
        {ok, T} ->
            T;
        error ->
            case actor_dp:admit_atoms(Seg, Bin) of
                true ->
                    case whole_term(Bin, []) of
                        {ok, T} -> T;
                        error -> {error, bad_reply}
                    end;
                false ->
                    {error, bad_reply}
            end
    end;
ring_answer(_Seg, Reply) ->
    Reply.

%% One whole term, as the NIF's own decode requires (binary_to_term/1
%% ignores bytes after the term).
whole_term(Bin, Opts) ->
    try binary_to_term(Bin, [used | Opts]) of
        {T, Used} when Used =:= byte_size(Bin) -> {ok, T};
        _ -> error
    catch error:badarg -> error
    end.
