%% A PropEr property of the receptionist against a simple model: random
%% sequences of register / deregister / subscribe / unsubscribe / subscriber
%% deaths on a few keys; afterwards `find' and `lookup' equal the model, and
%% every live subscriber got, for each key, exactly the listings the model
%% predicts, in order: one per subscribe and one per change of the key's
%% refs while subscribed, none for a non-change, none after unsubscribing. Run from actor_receptionist_tests (the application must run).
%% Kept apart from the EUnit module because proper.hrl and eunit.hrl define
%% the same macros.
-module(actor_receptionist_prop).

-include_lib("proper/include/proper.hrl").

-export([prop_matches_model/0]).

-define(KEYS, 3).
-define(REFS, 4).
-define(SUBS, 3).
-define(WAIT_MS, 10000).

prop_matches_model() ->
    ?FORALL(Ops, list(op()), run(Ops)).

op() ->
    frequency([{4, {register, key(), ref()}},
               {3, {deregister, key(), ref()}},
               {2, {subscribe, key(), sub()}},
               {1, {unsubscribe, key(), sub()}},
               {1, {kill, sub()}}]).

key() -> choose(1, ?KEYS).
ref() -> choose(1, ?REFS).
sub() -> choose(1, ?SUBS).

run(Ops) ->
    Run = erlang:unique_integer([positive]),
    Keys = list_to_tuple([actor_receptionist:service_key(
                            iolist_to_binary(io_lib:format("prop_~b_~b", [Run, I])))
                          || I <- lists:seq(1, ?KEYS)]),
    Refs = list_to_tuple([spawn(fun idle/0) || _ <- lists:seq(1, ?REFS)]),
    Subs0 = list_to_tuple([ap_test_util:spawn_collector() || _ <- lists:seq(1, ?SUBS)]),
    Model0 = {#{}, sets:new([{version, 2}]), #{}},
    {Subs, {Regs, Subscribed, ExpMap}} =
        lists:foldl(fun(Op, {S, M}) -> step(Op, Keys, Refs, S, M) end, {Subs0, Model0}, Ops),
    ap_test_util:rcpt_barrier(),
    Want = fun(KI) -> [element(RI, Refs) || RI <- maps:get(KI, Regs, [])] end,
    Found = [begin
                 K = element(KI, Keys),
                 ok = actor_receptionist:find(K, self()),
                 receive {listing, K, L} -> {KI, L} after ?WAIT_MS -> {KI, timeout} end
             end || KI <- lists:seq(1, ?KEYS)],
    Looked = [{KI, actor_receptionist:lookup(element(KI, Keys))} || KI <- lists:seq(1, ?KEYS)],
    Expected = [{KI, Want(KI)} || KI <- lists:seq(1, ?KEYS)],
    Pairs = [{SI, KI} || SI <- lists:seq(1, ?SUBS), KI <- lists:seq(1, ?KEYS)],
    GotListings = [{P, listings(element(SI, Subs), element(KI, Keys))} || {SI, KI} = P <- Pairs],
    ExpectedListings = [{P, [[element(RI, Refs) || RI <- L] || L <- lists:reverse(maps:get(P, ExpMap, []))]}
                        || P <- Pairs],
    %% Leave nothing behind for the next run.
    [ok = actor_receptionist:deregister(element(KI, Keys), element(RI, Refs))
     || {KI, RIs} <- maps:to_list(Regs), RI <- RIs],
    [exit(P, kill) || P <- tuple_to_list(Refs) ++ tuple_to_list(Subs)],
    _ = Subscribed,
    ?WHENFAIL(io:format(user, "ops ~p~nfind ~p~nlookup ~p~nwant ~p~nlistings ~p~nwant ~p~n",
                        [Ops, Found, Looked, Expected, GotListings, ExpectedListings]),
              Found =:= Expected andalso Looked =:= Expected
              andalso GotListings =:= ExpectedListings).

%% The model: {Regs, Subscribed, Expected}: the refs of each key in order,
%% the {Sub, Key} subscriptions, and per {Sub, Key} the listings (lists of
%% ref indices) the current process of slot Sub should have got, newest
%% first.
step({register, KI, RI}, Keys, Refs, Subs, {Regs, Subscribed, Exp}) ->
    ok = actor_receptionist:register(element(KI, Keys), element(RI, Refs)),
    L = maps:get(KI, Regs, []),
    case lists:member(RI, L) of
        true -> {Subs, {Regs, Subscribed, Exp}};
        false -> changed(KI, L ++ [RI], Subs, {Regs, Subscribed, Exp})
    end;
step({deregister, KI, RI}, Keys, Refs, Subs, {Regs, Subscribed, Exp}) ->
    ok = actor_receptionist:deregister(element(KI, Keys), element(RI, Refs)),
    L = maps:get(KI, Regs, []),
    case lists:member(RI, L) of
        true -> changed(KI, lists:delete(RI, L), Subs, {Regs, Subscribed, Exp});
        false -> {Subs, {Regs, Subscribed, Exp}}
    end;
step({subscribe, KI, SI}, Keys, _Refs, Subs, {Regs, Subscribed, Exp}) ->
    ok = actor_receptionist:subscribe(element(KI, Keys), element(SI, Subs)),
    %% A listing now, also for a second subscribe.
    {Subs, {Regs, sets:add_element({SI, KI}, Subscribed),
            add_listing({SI, KI}, maps:get(KI, Regs, []), Exp)}};
step({unsubscribe, KI, SI}, Keys, _Refs, Subs, {Regs, Subscribed, Exp}) ->
    ok = actor_receptionist:unsubscribe(element(KI, Keys), element(SI, Subs)),
    {Subs, {Regs, sets:del_element({SI, KI}, Subscribed), Exp}};
step({kill, SI}, _Keys, _Refs, Subs, {Regs, Subscribed, Exp}) ->
    exit(element(SI, Subs), kill),
    New = ap_test_util:spawn_collector(),
    Left = sets:filter(fun({S, _}) -> S =/= SI end, Subscribed),
    {setelement(SI, Subs, New), {Regs, Left, maps:filter(fun({S, _}, _) -> S =/= SI end, Exp)}}.

%% Key KI's refs changed to L: every subscriber of KI gets a listing.
changed(KI, L, Subs, {Regs, Subscribed, Exp}) ->
    Exp1 = sets:fold(fun({SI, K}, E) when K =:= KI -> add_listing({SI, KI}, L, E);
                        (_, E) -> E
                     end, Exp, Subscribed),
    {Subs, {Regs#{KI => L}, Subscribed, Exp1}}.

add_listing(Pair, L, Exp) ->
    maps:update_with(Pair, fun(Ls) -> [L | Ls] end, [L], Exp).

idle() ->
    receive stop -> ok end.

%% Every listing for Key that Sub got, in order.
listings(Sub, Key) ->
    [L || {listing, K, L} <- ap_test_util:collected(Sub), K =:= Key].
