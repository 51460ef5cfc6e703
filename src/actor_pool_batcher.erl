%% @doc Coalesces the messages that {@link actor_pool} sends to one pool node.
%%
%% Why: a BEAM writes one syscall per distribution message, which caps
%% unbatched traffic to a C node near 150K-230K msg/s here, while lists of
%% 64+ messages sent as one reach millions per second. So `tell/2' and
%% `ask/2,3' send through a batcher while the connection is busy, and send
%% directly, with no hop, when it is idle.
%%
%% <h3>Shape</h3>
%% Every pool node that this BEAM talks to gets a group of N batchers (N =
%% schedulers online, at least 2), started lazily under {@link
%% actor_pool_batch_sup} (one_for_all per group). A sender always uses batcher
%% `erlang:phash2(self(), N) + 1' of that node, so everything one process
%% sends to one pool node (tells, asks, stats, stop) leaves in the order it
%% was sent, over the one connection. N batchers spread the encoding work over
%% the schedulers: no single process is the bottleneck.
%%
%% A batcher blocks for its first item, then takes more with `receive ...
%% after 0', up to 256 items per round. A batch holds at most 1 MiB
%% (external size), and never more than fits in one frame of the pool node
%% (its `max_frame' less the envelope): a C node drops a frame over its
%% `max_frame' whole. The `max_frame' of this node's own pool node is known
%% (its actor_cnode options); for another pool node the floor that every
%% `max_frame' is at or above (64 KiB, see actor_cnode) is assumed, unless
%% it was learned ({@link max_frame/1}). Consecutive items for
%% the same destination become one distribution message
%% `{'$ap_batch', [{tell, Msg} | {ask, Pid, Tag, Msg}]}'; a group of one goes
%% out in its plain form (`Msg', or `{'$gen_call', {Pid, Tag}, Msg}'), so a
%% lone message costs nothing extra on the wire. Manager and stats calls
%% (`{call, ...}' items) are never put in a batch, only kept in order.
%%
%% <h3>The fast path: when a sender may skip its batcher</h3>
%% A sender sends directly (no hop) when both hold:
%% <ul>
%% <li>the connection is idle: nothing was sent to that node, directly or by
%%     a batcher, in the last `batch_idle_us' microseconds (application env,
%%     default 20; the time is one shared atomic, `LAST');</li>
%% <li>none of this sender's own items still waits in its batcher, so the
%%     direct send cannot overtake them.</li>
%% </ul>
%% The second rule needs no shared counter that a killed sender could leave
%% wrong. A batcher counts the moments it finds its mailbox empty (`OBS') and,
%% after sending everything it took before that moment, publishes the count
%% (`DONE'). A sender that hands an item over remembers `OBS' as read right
%% after the hand-over, in its process dictionary. The next empty-mailbox
%% moment comes after the item was in the mailbox, so once `DONE' exceeds the
%% remembered value the item has been sent. A group that restarted has new
%% atomics, which makes any remembered value stale (those items died with the
%% old batcher).
%%
%% <h3>Backpressure</h3>
%% A batcher blocked on a busy distribution port would let its mailbox grow
%% without bound, since sending to a local process never blocks. Senders count
%% what they hand over (`GIVEN') and batchers what they took (`TAKEN'); a
%% sender that finds more than 4096 items waiting in its batcher waits until
%% the batcher reaches a marker it queues behind its item.
-module(actor_pool_batcher).

-include("actor_pool_int.hrl").

%% API.
-export([send/3]).
-export([start_link/3]).
-export([unpublish_all/0]).
-export([max_frame/1]).
-export([queued/1]).

%% proc_lib and sys internals.
-export([init/4]).
-export([system_continue/3]).
-export([system_terminate/4]).
-export([system_code_change/4]).
-export([system_get_state/1]).

-export_type([item/0, dest/0]).

-type dest() :: pid() | {atom(), node()}.
%% Where a message goes: a pool pid, or `{RegisteredName, PoolNode}'.

-type tag() :: [alias | reference()] | reference().

-type item() :: {tell, term()}
              | {ask, pid(), tag(), term()}
              | {call, pid(), tag(), term()}.
%% `tell' and `ask' may be batched; `call' always goes out alone as a
%% `{'$gen_call', {Pid, Tag}, Msg}'.

%% Items per round and bytes per batch (external size, at most).
-define(MAX_ITEMS, 256).
-define(MAX_BYTES, 1048576).
%% Items waiting in one batcher beyond which a sender waits for it.
-define(HIGH_WATER, 4096).

%% Atomics layout, one array per group: slot 1 is LAST (monotonic us of the
%% last send to the node); batcher I uses slots 8I+1.. (one 64-byte cache
%% line each, so batchers do not share lines).
-define(LAST, 1).
-define(OBS(I), (8 * (I) + 1)).
-define(DONE(I), (8 * (I) + 2)).
-define(GIVEN(I), (8 * (I) + 3)).
-define(TAKEN(I), (8 * (I) + 4)).
-define(SLOTS(N), (8 * ((N) + 1))).

%% Process dictionary key of a sender's unsettled hand-over to a node.
-define(PENDING(Node), {'$actor_pool_pending', Node}).
%% persistent_term key of a node's group (read by every sender, written once
%% per group start; a group stopped for good is erased).
-define(GROUP_KEY(Node), {actor_pool_batcher, Node}).

-record(st, {
    %% the group supervisor
    parent :: pid(),
    %% the pool node this group serves
    node :: node(),
    %% 1..N
    index :: pos_integer(),
    %% the group's atomics (see the layout above)
    atomics :: atomics:atomics_ref(),
    %% bytes (external size) a batch may hold, and what a tell and an ask
    %% add to their message's size inside one
    limit :: pos_integer(),
    tell_extra :: pos_integer(),
    ask_extra :: pos_integer()
}).

%% ===================================================================
%% API
%% ===================================================================

%% @doc Sends `Item' to `Dest' on `Node', directly or through this process's
%% batcher for `Node' (see the module doc). Never fails: a destination that
%% does not exist drops the message, as `!' does; an ask then learns of it by
%% its reply or its monitor.
-spec send(node(), dest(), item()) -> ok.
send(Node, Dest, Item) ->
    case group(Node) of
        {ok, Group} -> route(Node, Group, Dest, Item);
        error -> direct(Dest, Item)
    end.

%% @private
%% @doc Starts batcher `Index' of `N' for `Node' (called by the group
%% supervisor, in index order).
-spec start_link(node(), pos_integer(), pos_integer()) -> {ok, pid()}.
start_link(Node, Index, N) ->
    proc_lib:start_link(?MODULE, init, [self(), Node, Index, N]).

%% ===================================================================
%% Sender side
%% ===================================================================

%% The group of Node, published by its last batcher (register_batcher/3):
%% {Atomics, IdleNative, {Batcher1, ..., BatcherN}}.
group(Node) ->
    case persistent_term:get(?GROUP_KEY(Node), undefined) of
        {_, _, Pids} = Group when is_tuple(Pids) ->
            {ok, Group};
        _ ->
            case actor_pool_batch_sup:start_group(Node) of
                ok ->
                    case persistent_term:get(?GROUP_KEY(Node), undefined) of
                        {_, _, Pids} = Group when is_tuple(Pids) -> {ok, Group};
                        _ -> error
                    end;
                error ->
                    %% The application is not running: send directly.
                    error
            end
    end.

route(Node, {A, Idle, Pids}, Dest, Item) ->
    I = erlang:phash2(self(), tuple_size(Pids)) + 1,
    Key = ?PENDING(Node),
    case settled(Key, A, I) of
        true when element(1, Item) =/= tell ->
            %% An ask (or call) blocks its sender until the reply, so a
            %% sender has at most one in flight and batching gains nothing:
            %% measured with 64 callers, the hop through the batcher cost
            %% more BEAM CPU per ask (36 us vs 26 us) than it saved. Direct,
            %% but still marking the connection busy for tells.
            atomics:put(A, ?LAST, erlang:monotonic_time()),
            direct(Dest, Item);
        true ->
            Now = erlang:monotonic_time(),
            case Now - atomics:get(A, ?LAST) >= Idle of
                true ->
                    atomics:put(A, ?LAST, Now),
                    direct(Dest, Item);
                false ->
                    enqueue(element(I, Pids), Key, A, I, Dest, Item)
            end;
        false ->
            enqueue(element(I, Pids), Key, A, I, Dest, Item)
    end.

%% True when nothing this sender handed to its batcher is still unsent.
settled(Key, A, I) ->
    case get(Key) of
        undefined ->
            true;
        {A, Obs} ->
            case atomics:get(A, ?DONE(I)) > Obs of
                true -> _ = erase(Key), true;
                false -> false
            end;
        _FromAnOldGroup ->
            _ = erase(Key),
            true
    end.

enqueue(Batcher, Key, A, I, Dest, Item) ->
    Batcher ! {'$ap', Dest, item_size(Item), Item},
    _ = put(Key, {A, atomics:get(A, ?OBS(I))}),
    Waiting = atomics:add_get(A, ?GIVEN(I), 1) - atomics:get(A, ?TAKEN(I)),
    case Waiting > ?HIGH_WATER of
        true -> throttle(Batcher);
        false -> ok
    end.

%% Wait until the batcher has worked through everything queued before us.
throttle(Batcher) ->
    Ref = erlang:monitor(process, Batcher),
    Batcher ! {'$ap_mark', self(), Ref},
    receive
        {Ref, ap_mark} -> erlang:demonitor(Ref, [flush]), ok;
        {'DOWN', Ref, process, _, _} -> ok
    end.

%% The message's external size (a binary's: its bytes and a 5-byte
%% header); the batcher adds its wrapper's.
item_size({tell, Msg}) -> msg_size(Msg);
item_size({ask, _, _, Msg}) -> msg_size(Msg);
item_size({call, _, _, _}) -> 0.

msg_size(Msg) when is_binary(Msg) -> byte_size(Msg) + 6;
msg_size(Msg) -> erlang:external_size(Msg).

%% @doc Items handed to each batcher of `Node''s group and not yet taken
%% out, batcher 1 first (`[]' when the node has no group): a gauge for the
%% metrics. Read from the group's atomics, racing the senders: a snapshot.
-spec queued(node()) -> [non_neg_integer()].
queued(Node) ->
    case persistent_term:get(?GROUP_KEY(Node), undefined) of
        {A, _Idle, Pids} ->
            [max(0, atomics:get(A, ?GIVEN(I)) - atomics:get(A, ?TAKEN(I)))
             || I <- lists:seq(1, tuple_size(Pids))];
        undefined ->
            []
    end.

%% @private
%% @doc The `max_frame' of pool node `Node' as far as this node knows it:
%% that of its own pool node (its actor_cnode options), one learned from
%% another pool node (actor_pool, for a large message), else `undefined'.
-spec max_frame(node()) -> pos_integer() | undefined.
max_frame(Node) ->
    case persistent_term:get(?POOL_MAX_FRAME_KEY, undefined) of
        {Node, MaxFrame} -> MaxFrame;
        _ -> persistent_term:get(?MAX_FRAME_KEY(Node), undefined)
    end.

%% Bytes a batch to Node may hold: under its max_frame, or under the floor
%% of every max_frame when it is not known.
batch_limit(Node) ->
    MaxFrame = case max_frame(Node) of
                   undefined -> ?MIN_MAX_FRAME;
                   M -> M
               end,
    min(?MAX_BYTES, MaxFrame - ?FRAME_ENVELOPE).

direct(Dest, Item) ->
    out(Dest, plain(Item)).

%% The form a single item takes on the wire. A tell that looks like one of the
%% pool's own protocol messages is wrapped as a cast, so the pool hands the
%% handler exactly what was told.
plain({tell, {'$gen_call', _, _} = Msg}) -> {'$gen_cast', Msg};
plain({tell, {'$gen_cast', _} = Msg}) -> {'$gen_cast', Msg};
plain({tell, {'$ap_batch', _} = Msg}) -> {'$gen_cast', Msg};
plain({tell, Msg}) -> Msg;
plain({ask, Pid, Tag, Msg}) -> {'$gen_call', {Pid, Tag}, Msg};
plain({call, Pid, Tag, Msg}) -> {'$gen_call', {Pid, Tag}, Msg}.

%% `!' to a registered name on this very node raises if the name is free;
%% everything else is silently dropped when the target is gone.
out(Dest, Msg) ->
    try erlang:send(Dest, Msg) of
        _ -> ok
    catch
        error:_ -> ok
    end.

%% ===================================================================
%% Batcher process
%% ===================================================================

%% @private
-dialyzer({no_improper_lists, init/4}).
-spec init(pid(), node(), pos_integer(), pos_integer()) -> no_return().
init(Parent, Node, Index, N) ->
    %% Trapped so that a shutdown first sends what is queued.
    process_flag(trap_exit, true),
    A = register_batcher(Node, Index, N),
    proc_lib:init_ack(Parent, {ok, self()}),
    %% An item's wrapper in a batch: {tell, Msg}, or {ask, Pid, Tag, Msg}
    %% with a pid and an alias of this node (the message's own size is
    %% counted by the sender). Rounded up for larger pid and ref encodings.
    TellExtra = erlang:external_size({tell, <<>>}) + 8,
    AskExtra = erlang:external_size({ask, self(), [alias | make_ref()], <<>>}) + 32,
    loop(#st{parent = Parent, node = Node, index = Index, atomics = A,
             limit = batch_limit(Node), tell_extra = TellExtra, ask_extra = AskExtra}).

%% Batcher 1 starts first (also after a one_for_all restart) and makes a fresh
%% staging row in ETS with fresh atomics; the others fill in their slot, and
%% the last one publishes the group in persistent_term, once: a replaced
%% persistent_term costs a global scan, so it happens once per group start.
register_batcher(Node, 1, N) ->
    A = atomics:new(?SLOTS(N), [{signed, true}]),
    Idle = idle_native(),
    atomics:put(A, ?LAST, erlang:monotonic_time() - (1 bsl 50)),
    Row = list_to_tuple([Node, A, Idle, self() | lists:duplicate(N - 1, undefined)]),
    true = ets:insert(?BATCH_TAB, Row),
    publish_if_last(Node, 1, N),
    A;
register_batcher(Node, Index, N) ->
    A = ets:lookup_element(?BATCH_TAB, Node, 2),
    true = ets:update_element(?BATCH_TAB, Node, {3 + Index, self()}),
    publish_if_last(Node, Index, N),
    A.

publish_if_last(Node, N, N) ->
    [Row] = ets:lookup(?BATCH_TAB, Node),
    [Node, A, Idle | Pids] = tuple_to_list(Row),
    persistent_term:put(?GROUP_KEY(Node), {A, Idle, list_to_tuple(Pids)});
publish_if_last(_Node, _Index, _N) ->
    ok.

%% @private
%% @doc Forgets every published group (the application stopped): senders then
%% send directly, or start new groups when the application runs again.
-spec unpublish_all() -> ok.
unpublish_all() ->
    _ = [persistent_term:erase(Key)
         || {{actor_pool_batcher, _} = Key, _} <- persistent_term:get()],
    ok.

idle_native() ->
    case idle_us() of
        infinity -> infinity;
        Us -> erlang:convert_time_unit(Us, microsecond, native)
    end.

idle_us() ->
    case application:get_env(actor_pool, batch_idle_us, 20) of
        Us when is_integer(Us), Us >= 0 -> Us;
        infinity -> infinity;
        _ -> 20
    end.

loop(St) ->
    receive
        Msg -> take(Msg, undefined, 0, [], 0, St)
    end.

%% One round. Dest/Bytes/Items: the group being built (Items reversed);
%% Count: '$ap' items taken this round.
take({'$ap', D, Size0, Item}, Dest, Bytes, Items, Count, St) ->
    case Item of
        {call, _, _, _} ->
            flush(Dest, Items),
            out(D, plain(Item)),
            next(undefined, 0, [], Count + 1, St);
        _ ->
            Size = Size0 + case Item of
                               {tell, _} -> St#st.tell_extra;
                               _ -> St#st.ask_extra
                           end,
            case D =:= Dest andalso Bytes + Size =< St#st.limit of
                true ->
                    next(Dest, Bytes + Size, [Item | Items], Count + 1, St);
                false ->
                    %% A batch is split by size too: one over the pool
                    %% node's max_frame would be dropped whole. (An item
                    %% alone goes out plain; its sender checked its size.)
                    flush(Dest, Items),
                    next(D, Size, [Item], Count + 1, St)
            end
    end;
take({'$ap_mark', Pid, Ref}, Dest, _Bytes, Items, Count, St) ->
    flush(Dest, Items),
    Pid ! {Ref, ap_mark},
    next(undefined, 0, [], Count, St);
take({system, From, Request}, Dest, _Bytes, Items, Count, St) ->
    flush(Dest, Items),
    end_round(Count, false, St),
    sys:handle_system_msg(Request, From, St#st.parent, ?MODULE, [], St);
take({'EXIT', Parent, Reason}, Dest, _Bytes, Items, Count, #st{parent = Parent} = St) ->
    flush(Dest, Items),
    end_round(Count, false, St),
    drain_and_exit(Reason, St);
take(_Unknown, Dest, Bytes, Items, Count, St) ->
    %% Not ours (a stray message): drop it, never let it sit in the mailbox.
    next(Dest, Bytes, Items, Count, St).

next(Dest, _Bytes, Items, Count, St) when Count >= ?MAX_ITEMS ->
    flush(Dest, Items),
    end_round(Count, false, St),
    loop(St);
next(Dest, Bytes, Items, Count, St) ->
    receive
        Msg -> take(Msg, Dest, Bytes, Items, Count, St)
    after 0 ->
        %% The mailbox is empty: everything handed over before this moment
        %% is in Items or already sent.
        Obs = atomics:add_get(St#st.atomics, ?OBS(St#st.index), 1),
        flush(Dest, Items),
        atomics:put(St#st.atomics, ?DONE(St#st.index), Obs),
        end_round(Count, true, St),
        loop(St)
    end.

end_round(Count, _Empty, #st{atomics = A, index = I}) ->
    atomics:add(A, ?TAKEN(I), Count),
    atomics:put(A, ?LAST, erlang:monotonic_time()).

flush(undefined, []) -> ok;
flush(Dest, [Item]) -> out(Dest, plain(Item));
flush(Dest, Items) -> out(Dest, {'$ap_batch', lists:reverse(Items)}).

%% Shutdown: send what is still queued (the supervisor's shutdown timeout
%% bounds this), then leave.
drain_and_exit(Reason, St) ->
    receive
        {'$ap', D, _Size, Item} ->
            out(D, plain(Item)),
            drain_and_exit(Reason, St);
        {'$ap_mark', Pid, Ref} ->
            Pid ! {Ref, ap_mark},
            drain_and_exit(Reason, St);
        _ ->
            drain_and_exit(Reason, St)
    after 0 ->
        exit(Reason)
    end.

%% ===================================================================
%% sys
%% ===================================================================

%% @private
-spec system_continue(pid(), [sys:dbg_opt()], #st{}) -> no_return().
system_continue(_Parent, _Debug, St) ->
    loop(St).

%% @private
-spec system_terminate(term(), pid(), [sys:dbg_opt()], #st{}) -> no_return().
system_terminate(Reason, _Parent, _Debug, St) ->
    drain_and_exit(Reason, St).

%% @private
-spec system_code_change(#st{}, module(), term(), term()) -> {ok, #st{}}.
system_code_change(St, _Module, _OldVsn, _Extra) ->
    {ok, St}.

%% @private
-spec system_get_state(#st{}) -> {ok, #st{}}.
system_get_state(St) ->
    {ok, St}.
