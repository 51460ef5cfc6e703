%% @private
%% @doc The cluster half of the receptionist, its view (see
%% actor_receptionist_gossip): the members and followers and the channels
%% to them, the origins held and where from, and whether the view is
%% complete. Called by actor_receptionist_gossip, in the server's process.
-module(actor_receptionist_gossip_view).

-include("actor_receptionist_int.hrl").
-include("actor_receptionist_gossip.hrl").

-export([probe/3, close/2, in_of/2, link_of/3, down/3, reprobe/1, hello/2, candidates/2,
         forget_probe/2, forget_follower/2, missing/3, want/3, ask/2, member_left/2]).
-export([effect/2, existing/1, ours/2, relayed/3, replace_origin/6, to_node/1]).
-export([complete/1, member_probes/1, release/1]).

-import(actor_receptionist_gossip_out,
        [chan_out/3, out/3, io_monitor/2, io_demonitor/2, io_nodes/2, io_timer/3]).

-type g() :: #g{}.

%% ===================================================================
%% Members
%% ===================================================================

%% Open a channel to Node's receptionist (Rel: what it will be to us),
%% unless one is open or opening.
-spec probe(node(), member | follower, g()) -> g().
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
-spec close(reference(), g()) -> g().
close(In, #g{chans = Chans} = G) ->
    io_demonitor(In, G),
    G#g{chans = maps:remove(In, Chans)}.

%% Our open alias for Node and its alias for us (`none' while probing),
%% or error.
-spec in_of(node(), g()) -> {ok, reference(), reference() | none} | error.
in_of(Node, #g{probing = Pr, peers = Peers, followers = Fs}) ->
    case {maps:find(Node, Pr), maps:find(Node, Peers), maps:find(Node, Fs)} of
        {{ok, #probe{in = In}}, _, _} -> {ok, In, none};
        {_, {ok, #peer{in = In, out = Out}}, _} -> {ok, In, Out};
        {_, _, {ok, #peer{in = In, out = Out}}} -> {ok, In, Out};
        _ -> error
    end.

%% The member or follower whose channel In is.
-spec link_of(node(), reference(), g()) -> {peers | followers, #peer{}} | {none, none}.
link_of(Node, In, #g{peers = Peers, followers = Fs}) ->
    case {maps:find(Node, Peers), maps:find(Node, Fs)} of
        {{ok, #peer{in = In} = P}, _} -> {peers, P};
        {_, {ok, #peer{in = In} = P}} -> {followers, P};
        _ -> {none, none}
    end.

%% Our monitor of Node's server reported: it runs none, or it ended.
-spec down(node(), reference(), g()) -> g().
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

-spec reprobe(g()) -> g().
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
-spec hello(reference(), g()) -> {ap_rcpt2_hello, reference(), member | follower}.
hello(In, #g{hidden = true}) ->
    {ap_rcpt2_hello, In, follower};
hello(In, #g{}) ->
    {ap_rcpt2_hello, In, member}.

%% The nodes to probe at start: visible ones; a hidden node has only hidden
%% connections, its own C nodes aside.
-spec candidates([node()], g()) -> [node()].
candidates(_CNodes, #g{hidden = false} = G) ->
    io_nodes(visible, G);
candidates(CNodes, #g{hidden = true} = G) ->
    io_nodes(connected, G) -- CNodes.

-spec forget_probe(node(), g()) -> g().
forget_probe(Node, #g{probing = Pr} = G) ->
    case maps:take(Node, Pr) of
        {#probe{in = In}, Pr1} -> close(In, G#g{probing = Pr1});
        error -> G
    end.

-spec forget_follower(node(), g()) -> g().
forget_follower(Node, #g{followers = Fs} = G) ->
    case maps:take(Node, Fs) of
        {#peer{in = In}, Fs1} -> close(In, G#g{followers = Fs1});
        error -> G
    end.

%% Whether we still lack a member's state, or a version of it seen
%% elsewhere (`done': we hold that version now).
-spec missing(node(), #peer{}, g()) -> boolean() | done.
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
-spec want(node(), {non_neg_integer(), non_neg_integer()}, g()) -> g().
want(Node, Want, #g{peers = Peers} = G) ->
    case maps:find(Node, Peers) of
        {ok, #peer{wanted = W} = P} when W =:= none; W < Want ->
            ask(Node, G#g{peers = Peers#{Node := P#peer{wanted = Want}}});
        _ ->
            ask(Node, G)
    end.

%% Ask a member for its whole state, once a round.
-spec ask(node(), g()) -> g().
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

-spec member_left(node(), g()) -> g().
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

-spec replace_origin(node(), non_neg_integer(), non_neg_integer(), direct | node(), [{binary(), pid()}], g()) -> g().
replace_origin(Origin, Inc, Ver, Via, Regs, #g{origins = Os} = G) ->
    effect({replace_origin, Origin, Regs}, G#g{origins = Os#{Origin => {Inc, Ver, Via}}}).

%% The origins member Via reaches directly (by name): fetch those we do not
%% reach ourselves and hold at another version (through this member, or
%% not at all); and a relayed origin its relay no longer lists moves to
%% another member that lists it, or goes.
-spec relayed(node(), #{binary() => {non_neg_integer(), non_neg_integer()}}, g()) -> g().
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
-spec ours(binary(), g()) -> boolean().
ours(Name, #g{node = Self, peers = Peers}) ->
    case existing(Name) of
        {ok, O} -> O =:= Self orelse is_map_key(O, Peers);
        error -> false
    end.

%% The atom a node name is, if one exists: nothing here makes one.
-spec existing(binary()) -> {ok, atom()} | error.
existing(Name) ->
    try {ok, binary_to_existing_atom(Name, utf8)}
    catch error:badarg -> error
    end.

%% A node name as an atom, made if need be: only for an origin a member
%% relays to us on request. `name@host', as net_kernel takes it.
-spec to_node(binary()) -> {ok, atom()} | error.
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

-spec effect(actor_receptionist_gossip:effect(), g()) -> g().
effect(E, #g{effects = Es} = G) ->
    G#g{effects = [E | Es]}.


%% ===================================================================
%% Completeness
%% ===================================================================

%% Nodes we wait for to answer as members: for three rounds (a
%% follower's channel being opened is not waited for).
-spec member_probes(g()) -> [node()].
member_probes(#g{probing = Pr}) ->
    [N || {N, #probe{rel = member, rounds = R}} <- maps:to_list(Pr), R > 0].

-spec complete(g()) -> boolean().
complete(#g{peers = Peers} = G) ->
    member_probes(G) =:= [] andalso
        lists:all(fun(#peer{synced = S}) -> S end, maps:values(Peers)).

%% Subscriptions held for a complete view go out once it is.
-spec release(g()) -> g().
release(#g{waiting = []} = G) ->
    G;
release(#g{waiting = W} = G) ->
    case complete(G) of
        true -> lists:foldl(fun({Id, Pid}, S) -> effect({subscribe, Id, Pid}, S) end,
                            G#g{waiting = []}, W);
        false -> G
    end.
