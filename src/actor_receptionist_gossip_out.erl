%% @private
%% @doc What the cluster half of the receptionist sends (see
%% actor_receptionist_gossip): on a channel, deltas, whole states and
%% digests, and what it counts of what goes out and comes in; and the
%% outside world it sends through (its io()). Called by
%% actor_receptionist_gossip and actor_receptionist_gossip_view, in the
%% server's process.
-module(actor_receptionist_gossip_out).

-include("actor_receptionist_gossip.hrl").

-export([chan_out/3, send_deltas/5, send_state/3, digest/1, answer/2, out/3, sent/2, count_in/2]).
-export([real_io/0, io_monitor/2, io_demonitor/2, io_nodes/2, io_timer/3]).

%% Ops per delta message.
-define(MAX_DELTA, 4096).

-type g() :: #g{}.

%% ===================================================================
%% Sending
%% ===================================================================

%% On a channel: Out is the other side's alias for us, and the tag it
%% checks.
-spec chan_out(reference(), term(), g()) -> g().
chan_out(Out, Body, G) ->
    out(Out, {ap_rcpt2, Out, Body}, G).

-spec send_deltas([actor_receptionist_gossip:op()], non_neg_integer(), non_neg_integer(), #{node() => #peer{}}, g()) -> g().
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
-spec send_state(reference(), fun(() -> [{binary(), pid()}]), g()) -> g().
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
-spec digest(g()) -> g().
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
-spec answer(node(), g()) -> g().
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
-spec out(reference() | {atom(), node()}, term(), g()) -> g().
out(Dest, Msg, #g{io = #{send := Send}} = G) ->
    case Send(Dest, Msg) of
        ok -> sent(Msg, G);
        _ -> G
    end.

%% Count Msg as gossip sent (the server sends origin states itself).
-spec sent(term(), g()) -> g().
sent(Msg, #g{bytes = B, msgs_sent = N} = G) ->
    G#g{bytes = B + erlang:external_size(Msg), msgs_sent = N + 1}.

%% Gossip taken in: the other receptionists' messages (ap_rcpt2*, and the
%% older protocol's); whole states (a member's, or an origin's through a
%% relay) also as full syncs.
-spec count_in(term(), g()) -> g().
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
-spec real_io() -> map(). % an io() without its fanout, which the caller gives
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

-spec io_monitor({atom(), node()}, g()) -> reference().
io_monitor(Target, #g{io = #{monitor := F}}) ->
    F(Target).

-spec io_demonitor(reference(), g()) -> ok.
io_demonitor(Mref, #g{io = #{demonitor := F}}) ->
    _ = F(Mref),
    ok.

-spec io_nodes(visible | connected, g()) -> [node()].
io_nodes(Kind, #g{io = #{nodes := F}}) ->
    F(Kind).

-spec io_timer(pos_integer(), term(), g()) -> ok.
io_timer(Ms, Msg, #g{io = #{timer := F}}) ->
    _ = F(Ms, Msg),
    ok.
