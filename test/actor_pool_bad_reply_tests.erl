%% Replies that cannot hurt anyone else (issue 45, point 3), against the
%% real pool node the application starts, with the test plugin
%% plugin_badreply.so replying whatever bytes it is told to.
%%
%% A term reply the BEAM would refuse (a NaN, a 300-character atom, an atom
%% that is not UTF-8, a map with a duplicate key, a malformed pid, port or
%% reference, a fun) is answered `{error, bad_reply}' to its asker alone:
%% asks in flight to another pool of the same pool node are answered as
%% usual (over distribution the refused term used to close the connection,
%% and every ask in flight got `nodedown'), the pool counts it
%% (`bad_replies') and logs the first one only. Replies the BEAM accepts
%% pass unchanged: a generated set of terms, each judged here by
%% binary_to_term/1 first. And a plugin cannot grow this BEAM's atom table
%% past its pool's `max_reply_atoms': 20000 asks each answered with a fresh
%% atom add at most that many. Each case runs in both isolation modes and
%% over both transports (rings, and distribution with `fast_path => false').
%%
%% ACTOR_POOL_IO (uring | epoll) selects the pool node's I/O backend;
%% ACTOR_POOL_NODE_EXE runs its ASan build.
-module(actor_pool_bad_reply_tests).

-import(ap_support, [wait_until/2]).

-include_lib("eunit/include/eunit.hrl").

-export([refused_replies_reach_their_asker_alone/1,
         accepted_replies_pass_and_refused_ones_are_bad_reply/1,
         fresh_atoms_stop_at_the_budget/1,
         new_atoms_within_the_budget_arrive_in_any_shape/1,
         atom_budget_is_validated_on_both_sides/1]).

%% A log handler's callback.
-export([log/2]).
%% The generator, for offline runs against other seeds.
-export([gen/2, judge/1]).

-define(ASK_MS, 20000).
%% How long the other pool's asks sleep: long enough to be in flight while
%% every refused reply is sent.
-define(SLEEP_MS, 1500).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_pool_bad_reply_test_() ->
    {setup, fun ap_test_util:pool_setup/0, fun ap_test_util:pool_cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 300, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [refused_replies_reach_their_asker_alone,
                          accepted_replies_pass_and_refused_ones_are_bad_reply,
                          fresh_atoms_stop_at_the_budget,
                          new_atoms_within_the_budget_arrive_in_any_shape,
                          atom_budget_is_validated_on_both_sides]]
     end}.

plugin() ->
    {plugin, ap_support:test_bin("plugin_badreply.so")}.

%% Isolation modes and transports.
modes() ->
    [{I, F} || I <- [thread, process], F <- [true, false]].

with_pool(Name, {Isolation, FastPath}, Opts, Fun) ->
    ap_test_util:with_pool(Name, plugin(), Opts#{isolation => Isolation, fast_path => FastPath,
                                                 workers => maps:get(workers, Opts, 2)}, Fun).

name(Case, {I, F}) ->
    list_to_atom(lists:concat([Case, "_", I, "_", case F of true -> ring; false -> dist end])).

%% The path the pool's messages came by: every case checks it took the one
%% it means to test.
assert_path(P, {_, FastPath}) ->
    #{by_path := #{ring := R, dist := D}} = actor_pool:stats(P),
    case FastPath of
        true -> ?assert(R > 0 andalso D =:= 0);
        false -> ?assert(D > 0 andalso R =:= 0)
    end.

%% ===================================================================
%% Refused replies
%% ===================================================================

%% Encoded terms (no 131) the BEAM refuses, named.
refused() ->
    Self = term_to_binary(self()),
    Ref = term_to_binary(make_ref()),
    Port = term_to_binary(hd(erlang:ports())),
    Fun = term_to_binary(fun() -> ok end),
    [{nan, <<70, 16#7ff8000000000000:64>>},
     {infinity, <<70, 16#7ff0000000000000:64>>},
     {minus_infinity, <<70, 16#fff0000000000000:64>>},
     {nan_in_a_list, <<108, 2:32, 97, 1, 70, 16#7ff8000000000001:64, 106>>},
     {atom_of_300_characters, utf8_atom(binary:copy(<<"a">>, 300))},
     {atom_of_256_two_byte_characters, utf8_atom(binary:copy(<<16#c3, 16#a9>>, 256))},
     {latin1_atom_of_256, <<100, 256:16, (binary:copy(<<"a">>, 256))/binary>>},
     {overlong_utf8_atom, <<119, 2, 16#c0, 16#af>>},
     {surrogate_utf8_atom, <<119, 3, 16#ed, 16#a0, 16#80>>},
     {truncated_utf8_atom, <<119, 2, 16#e2, 16#82>>},
     {utf8_atom_past_u10ffff, <<119, 4, 16#f4, 16#90, 16#80, 16#80>>},
     {not_utf8_node_in_a_pid, <<88, 119, 3, 16#ff, $@, $h, 1:32, 0:32, 1:32>>},
     {duplicate_key, map([{<<97, 1>>, <<106>>}, {<<97, 1>>, <<106>>}])},
     {duplicate_key_small_int_and_big, map([{<<97, 1>>, <<106>>}, {<<110, 2, 0, 1, 0>>, <<106>>}])},
     {duplicate_key_int_and_small_int, map([{<<98, 7:32>>, <<106>>}, {<<97, 7>>, <<106>>}])},
     {duplicate_key_negative_big, map([{<<98, -5:32/signed>>, <<106>>}, {<<111, 1:32, 1, 5>>, <<106>>}])},
     {duplicate_key_latin1_and_utf8_atom, map([{<<100, 1:16, 16#e9>>, <<106>>},
                                               {<<119, 2, 16#c3, 16#a9>>, <<106>>}])},
     {duplicate_key_string_and_list, map([{<<107, 2:16, "ab">>, <<106>>},
                                          {<<108, 1:32, 97, $a, 107, 1:16, "b">>, <<106>>}])},
     {duplicate_key_zero_and_minus_zero, map([{<<70, 0:64>>, <<106>>}, {<<70, 1:1, 0:63>>, <<106>>}])},
     {duplicate_key_tuples, map([{<<104, 1, 97, 1>>, <<106>>}, {<<105, 1:32, 97, 1>>, <<106>>}])},
     {duplicate_key_binary_and_bits, map([{<<109, 1:32, 7>>, <<106>>}, {<<77, 1:32, 8, 7>>, <<106>>}])},
     {duplicate_key_maps_in_any_order,
      map([{map([{<<97, 1>>, <<97, 2>>}, {<<97, 3>>, <<97, 4>>}]), <<106>>},
           {map([{<<97, 3>>, <<97, 4>>}, {<<97, 1>>, <<97, 2>>}]), <<106>>}])},
     {duplicate_key_among_40, map([{<<98, K:32>>, <<106>>} || K <- lists:seq(1, 39)] ++ [{<<97, 20>>, <<106>>}])},
     {pid_with_creation_4, <<103, 119, 3, "a@h", 1:32, 0:32, 4>>},
     {own_pid_numbered_past_15_bits, own(Self, fun(<<88, R/binary>>, N) ->
                                                        <<88, (binary:part(R, 0, N))/binary, 16#8000:32,
                                                          (binary:part(R, N + 4, 8))/binary>>
                                                end)},
     {reference_word_past_18_bits, <<101, 119, 3, "a@h", 16#40000:32, 1>>},
     {own_reference_of_4_words, own(Ref, fun(<<90, _:16, R/binary>>, N) ->
                                                 <<90, 4:16, (binary:part(R, 0, N + 4))/binary,
                                                   1:32, 2:32, 3:32, 4:32>>
                                         end)},
     {port_with_creation_4, <<102, 119, 3, "a@h", 1:32, 4>>},
     {own_port_numbered_past_28_bits, own(Port, fun(<<_Tag, R/binary>>, N) ->
                                                        Cr = binary:part(R, byte_size(R) - 4, 4),
                                                        <<120, (binary:part(R, 0, N))/binary, 16#10000000:64,
                                                          Cr/binary>>
                                                end)},
     {fun_, binary:part(Fun, 1, byte_size(Fun) - 1)},
     {fun_in_a_tuple, <<104, 2, 97, 1, (binary:part(Fun, 1, byte_size(Fun) - 1))/binary>>}].

%% Replies of kind atom (the handler gives the text, the pool encodes it).
refused_atoms() ->
    [{atom_reply_of_300_characters, binary:copy(<<"b">>, 300)},
     {atom_reply_not_utf8, <<"ab", 16#ff>>}].

utf8_atom(Text) when byte_size(Text) < 256 -> <<119, (byte_size(Text)), Text/binary>>;
utf8_atom(Text) -> <<118, (byte_size(Text)):16, Text/binary>>.

map(KVs) -> <<116, (length(KVs)):32, (iolist_to_binary([[K, V] || {K, V} <- KVs]))/binary>>.

%% Ext (a term_to_binary of a pid, port or reference of this node) remade by
%% Remake(Ext without 131, N): N is where the node atom ends, after the tag
%% (and a reference's word count).
own(<<131, Tag, _/binary>> = Ext, Remake) ->
    Body = binary:part(Ext, 1, byte_size(Ext) - 1),
    Skip = case Tag of 90 -> 3; _ -> 1 end,
    N = case Body of
            <<_:Skip/binary, A, L:16, _/binary>> when A =:= 100; A =:= 118 -> 3 + L;
            <<_:Skip/binary, A, L, _/binary>> when A =:= 115; A =:= 119 -> 2 + L
        end,
    Remake(Body, N).

refused_replies_reach_their_asker_alone(_Ctx) ->
    %% Each kind is refused by this BEAM itself.
    [?assertError(badarg, binary_to_term(<<131, B/binary>>)) || {_, B} <- refused(), not is_fun_case(B)],
    [run_refused(M) || M <- modes()].

is_fun_case(<<112, _/binary>>) -> true;
is_fun_case(<<104, 2, 97, 1, 112, _/binary>>) -> true;
is_fun_case(_) -> false.

run_refused(Mode) ->
    Handler = add_log_handler(),
    Bad = name(refused, Mode),
    Other = name(refused_other, Mode),
    try
        with_pool(Other, Mode, #{workers => 4}, fun(O) ->
            with_pool(Bad, Mode, #{}, fun(P) ->
                %% Asks in flight to the other pool all through.
                Self = self(),
                Slow = [spawn_link(fun() ->
                                           Self ! {slow, self(), actor_pool:ask(O, <<"sleep:", (integer_to_binary(?SLEEP_MS))/binary>>,
                                                                                ?ASK_MS)}
                                   end) || _ <- lists:seq(1, 4)],
                ok = wait_until(fun() -> in_flight(O) >= 4 end, ?ASK_MS),
                Kinds = [{K, <<"term:", B/binary>>} || {K, B} <- refused()]
                    ++ [{K, <<"atom:", B/binary>>} || {K, B} <- refused_atoms()],
                Got = [{K, actor_pool:ask(P, Msg, ?ASK_MS)} || {K, Msg} <- Kinds],
                ?assertEqual([{K, {error, bad_reply}} || {K, _} <- Kinds], Got),
                %% The pool itself serves on.
                ?assertEqual({ok, <<"after">>}, actor_pool:ask(P, <<"after">>, ?ASK_MS)),
                ?assertEqual({ok, {a, [1.5]}}, actor_pool:ask(P, {a, [1.5]}, ?ASK_MS)),
                [receive {slow, S, R} -> ?assertEqual({ok, <<"slept">>}, R)
                 after ?ASK_MS -> error(slow_ask_unanswered)
                 end || S <- Slow],
                ?assertMatch(#{bad_replies := N} when N =:= length(Kinds), actor_pool:stats(P)),
                ?assertMatch(#{bad_replies := 0}, actor_pool:stats(O)),
                assert_path(P, Mode),
                assert_path(O, Mode),
                %% Logged once. The barrier: a refusal by the other pool,
                %% logged after every line P's refusals caused (the pool
                %% node's log has one writer, in order).
                ?assertEqual({error, bad_reply}, actor_pool:ask(O, <<"term:", 70, -1:64>>, ?ASK_MS)),
                ok = wait_until(fun() -> lines(Other) =:= 1 end, ?ASK_MS),
                ?assertEqual(1, lines(Bad))
            end)
        end)
    after
        ok = logger:remove_handler(Handler)
    end.

%% Asks sent and not yet answered by O's workers (queued or running).
in_flight(O) ->
    lists:sum([M || #{mailbox := M} <- maps:get(workers, actor_pool:stats(O))]).

%% ===================================================================
%% Accepted replies, and the differential check
%% ===================================================================

%% Every generated term is judged by this BEAM's binary_to_term/1 first:
%% what it takes must come back as the same term, what it refuses must be
%% {error, bad_reply}, never a closed connection.
accepted_replies_pass_and_refused_ones_are_bad_reply(_Ctx) ->
    Terms = generated(400),
    Verdicts = [{B, judge(B)} || B <- Terms],
    %% The set holds both kinds, in numbers.
    ?assert(length([x || {_, {ok, _}} <- Verdicts]) > 100),
    ?assert(length([x || {_, error} <- Verdicts]) > 100),
    [run_generated(M, Verdicts) || M <- modes()].

%% What this BEAM makes of B: {ok, Term}, or error. A hash map holding
%% two equal external references counts as refused: OTP 25 builds one (its
%% hash map builder misses that duplicate, which the small-map one and the
%% pool node's check both refuse), a map that breaks its own invariant.
judge(B) ->
    try binary_to_term(<<131, B/binary>>) of
        T ->
            case sound(T) of
                true -> {ok, T};
                false -> error
            end
    catch error:badarg -> error
    end.

sound(M) when is_map(M) ->
    Ks = maps:keys(M),
    distinct(Ks) andalso lists:all(fun sound/1, Ks ++ maps:values(M));
sound(T) when is_tuple(T) -> sound(tuple_to_list(T));
sound([H | T]) -> sound(H) andalso sound(T);
sound(_) -> true.

%% T with its maps as sorted lists: two decodes of one hash map with
%% external references as keys compare unequal on OTP 25 (their hashes
%% differ), though they hold the same pairs.
plain(M) when is_map(M) -> {map, lists:sort([{plain(K), plain(V)} || {K, V} <- maps:to_list(M)])};
plain(T) when is_tuple(T) -> list_to_tuple(plain(tuple_to_list(T)));
plain([H | T]) -> [plain(H) | plain(T)];
plain(X) -> X.

%% No two =:= (usort would take 1 and 1.0 for one).
distinct([K | Ks]) -> not lists:any(fun(K2) -> K2 =:= K end, Ks) andalso distinct(Ks);
distinct([]) -> true.

run_generated(Mode, Verdicts) ->
    with_pool(name(generated, Mode), Mode, #{}, fun(P) ->
        Got = [{B, actor_pool:ask(P, <<"term:", B/binary>>, ?ASK_MS)} || {B, _} <- Verdicts],
        Want = [{B, case V of {ok, T} -> {ok, T}; error -> {error, bad_reply} end} || {B, V} <- Verdicts],
        ?assertEqual({Mode, []}, {Mode, [{W, G} || {W, G} <- lists:zip(Want, Got), plain(W) =/= plain(G)]}),
        assert_path(P, Mode)
    end).

%% N terms from a fixed seed: containers of pieces that sit on either side
%% of what the BEAM accepts.
generated(N) ->
    S0 = rand:seed_s(exsss, {45, 3, 2026}),
    {Terms, _} = lists:mapfoldl(fun(_, S) -> gen(3, S) end, S0, lists:seq(1, N)),
    Terms.

gen(0, S) ->
    piece(S);
gen(D, S) ->
    {X, S1} = rand:uniform_s(11, S),
    if
        X =< 4 -> piece(S1);
        X =:= 11 ->
            %% Over 32 keys (a hash map): {Piece, I}, and maybe one of
            %% them again as a large tuple with an INTEGER_EXT.
            {P, S2} = piece(S1),
            {Again, S3} = rand:uniform_s(2, S2),
            Keys = [<<104, 2, P/binary, 97, I>> || I <- lists:seq(1, 33)]
                ++ [<<105, 2:32, P/binary, 98, 7:32>> || Again =:= 2],
            {map([{K, <<106>>} || K <- Keys]), S3};
        X =< 6 ->
            {Len, S2} = rand:uniform_s(4, S1),
            {Es, S3} = gen_n(Len, D - 1, S2),
            {<<104, Len, (iolist_to_binary(Es))/binary>>, S3};
        X =< 8 ->
            {Len, S2} = rand:uniform_s(4, S1),
            {Es, S3} = gen_n(Len, D - 1, S2),
            {Tail, S4} = gen(D - 1, S3),
            {<<108, Len:32, (iolist_to_binary(Es))/binary, Tail/binary>>, S4};
        true ->
            %% Keys may be containers too (maps among them).
            {Len, S2} = rand:uniform_s(3, S1),
            {Ks, S3} = gen_n(Len, min(D - 1, 2), S2),
            {Vs, S4} = gen_n(Len, D - 1, S3),
            {map(lists:zip(Ks, Vs)), S4}
    end.

gen_n(N, D, S) ->
    lists:mapfoldl(fun(_, Si) -> gen(D, Si) end, S, lists:seq(1, N)).

piece(S) ->
    Pieces = pieces(),
    {I, S1} = rand:uniform_s(tuple_size(Pieces), S),
    {element(I, Pieces), S1}.

%% Small terms, many of them equal to another under a different encoding
%% (as map keys they make duplicates), some of them refused alone.
pieces() ->
    Self = term_to_binary(self()),
    Ref = term_to_binary(make_ref()),
    list_to_tuple(
      [<<97, 1>>, <<98, 1:32>>, <<110, 1, 0, 1>>, <<110, 2, 0, 1, 0>>, <<111, 1:32, 1, 1>>,
       <<98, -1:32/signed>>, <<110, 0, 1>>, <<97, 0>>,
       <<70, 0:64>>, <<70, 1:1, 0:63>>, <<70, 1.5:64/float>>, <<70, 16#7ff8000000000000:64>>,
       <<70, 16#7ff0000000000000:64>>,
       <<100, 1:16, "a">>, <<115, 1, "a">>, <<119, 1, "a">>, <<118, 1:16, "a">>,
       <<100, 1:16, 16#e9>>, <<119, 2, 16#c3, 16#a9>>, <<119, 2, 16#c3, 16#28>>,
       <<119, 3, 16#e0, 16#80, 16#af>>, <<119, 4, 16#f0, 16#9f, 16#98, 16#80>>,
       utf8_atom(binary:copy(<<"z">>, 255)), utf8_atom(binary:copy(<<"z">>, 256)),
       <<107, 2:16, "ab">>, <<108, 2:32, 97, $a, 97, $b, 106>>, <<107, 0:16>>, <<106>>,
       <<108, 0:32, 97, 1>>,
       <<109, 1:32, 7>>, <<77, 1:32, 8, 7>>, <<77, 1:32, 4, 16#f0>>, <<77, 1:32, 4, 16#ff>>,
       <<77, 0:32, 0>>, <<109, 0:32>>,
       <<104, 0>>, <<105, 0:32>>, <<116, 0:32>>,
       <<88, 119, 3, "a@h", 1:32, 0:32, 1:32>>, <<103, 119, 3, "a@h", 1:32, 0:32, 1>>,
       <<103, 119, 3, "a@h", 1:32, 0:32, 9>>, <<88, 119, 3, "a@h", 1:32, 0:32, 2:32>>,
       binary:part(Self, 1, byte_size(Self) - 1),
       own(Self, fun(<<88, R/binary>>, N) ->
                         <<88, (binary:part(R, 0, N + 4))/binary, 16#2000:32, (binary:part(R, N + 8, 4))/binary>>
                 end),
       binary:part(Ref, 1, byte_size(Ref) - 1),
       <<90, 1:16, 119, 3, "a@h", 1:32, 5:32>>, <<90, 3:16, 119, 3, "a@h", 1:32, 5:32, 0:32, 0:32>>,
       <<101, 119, 3, "a@h", 5:32, 1>>, <<114, 1:16, 119, 3, "a@h", 1, 16#40000:32>>,
       <<89, 119, 3, "a@h", 7:32, 1:32>>, <<120, 119, 3, "a@h", 7:64, 1:32>>, <<102, 119, 3, "a@h", 7:32, 1>>,
       <<113, 119, 5, "lists", 119, 4, "sort", 97, 1>>]).

%% ===================================================================
%% The atom budget
%% ===================================================================

%% 20000 asks, each answered with an atom this BEAM never saw: at most the
%% pool's budget of them is ever made (the default, 1024; the rest are
%% bad_reply), on both transports and in both isolation modes.
fresh_atoms_stop_at_the_budget(_Ctx) ->
    [run_fresh(M) || M <- modes()].

run_fresh(Mode) ->
    Budget = 1024,
    Asks = 20000,
    Prefix = "apfresh" ++ integer_to_list(erlang:unique_integer([positive])) ++ "_",
    with_pool(name(fresh, Mode), Mode, #{workers => 4}, fun(P) ->
        {ok, ok} = actor_pool:ask(P, <<"term:", (utf8_atom(<<"ok">>))/binary>>, ?ASK_MS),
        ?assertMatch(#{max_reply_atoms := Budget}, actor_pool:stats(P)),
        Before = erlang:system_info(atom_count),
        Results = par(8, Asks, fun(I) ->
                                       Name = list_to_binary(Prefix ++ integer_to_list(I)),
                                       actor_pool:ask(P, <<"term:", (utf8_atom(Name))/binary>>, ?ASK_MS)
                               end),
        Grew = erlang:system_info(atom_count) - Before,
        Ok = length([x || {ok, A} <- Results, is_atom(A)]),
        Bad = length([x || {error, bad_reply} <- Results]),
        ?assertEqual(Asks, Ok + Bad),
        %% 'ok' came first: one name of the budget.
        ?assertEqual({Mode, Budget - 1}, {Mode, Ok}),
        ?assert(Grew =< Budget + 16),
        #{bad_replies := Bad, reply_atoms := Budget} = actor_pool:stats(P),
        %% A name already carried still passes.
        ?assertEqual({ok, ok}, actor_pool:ask(P, <<"term:", (utf8_atom(<<"ok">>))/binary>>, ?ASK_MS)),
        assert_path(P, Mode)
    end).

%% Atoms this BEAM never saw, within the budget, arrive whatever carries
%% them: maps of over 32 keys in replies of over 64 KiB from 8 callers at
%% once (on the rings the NIF's reply thread hands those to their asker to
%% decode, in actor_pool_transport, where the segment's allowance of new
%% atoms applies as in the NIF), a pid of a node never seen (its node is an
%% atom too) in a small map.
new_atoms_within_the_budget_arrive_in_any_shape(_Ctx) ->
    [begin
         Prefix = "apshape" ++ integer_to_list(erlang:unique_integer([positive])) ++ "_",
         Name = fun(I) -> list_to_binary(Prefix ++ integer_to_list(I)) end,
         Big = fun(C) -> map([{utf8_atom(Name(C * 100 + I)), <<97, 1>>} || I <- lists:seq(1, 40)]) end,
         Pid = <<88, (utf8_atom(<<(Name(1))/binary, "@h">>))/binary, 1:32, 0:32, 1:32>>,
         Small = map([{utf8_atom(Name(2)), Pid}]),
         with_pool(name(shape, Mode), Mode, #{workers => 4}, fun(P) ->
             Pad = 70000,
             Ask = fun(B) -> {B, actor_pool:ask(P, <<"padded:", Pad:32, B/binary>>, ?ASK_MS)} end,
             Got = [Ask(Small) | par(8, 8, fun(C) -> Ask(Big(C)) end)],
             ?assertEqual([{B, {ok, {binary_to_term(<<131, B/binary>>), <<0:Pad/unit:8>>}}} || {B, _} <- Got],
                          Got),
             ?assertMatch(#{reply_atoms := 322, bad_replies := 0}, actor_pool:stats(P)),
             assert_path(P, Mode)
         end)
     end || Mode <- modes()].

%% F(1..N) over C processes; the results in no particular order.
par(C, N, F) ->
    Self = self(),
    Pids = [spawn_link(fun() -> Self ! {par, self(), [F(I) || I <- lists:seq(K, N, C)]} end)
            || K <- lists:seq(1, C)],
    lists:append([receive {par, P, R} -> R after 120000 -> error(par_timeout) end || P <- Pids]).

atom_budget_is_validated_on_both_sides(#{pool_node := PN}) ->
    Bad = [0, -1, 1048577, 1.0, many, infinity],
    [?assertEqual({V, {error, {badarg, {max_reply_atoms, V}}}},
                  {V, actor_pool:start_pool(?FUNCTION_NAME, echo, #{max_reply_atoms => V})}) || V <- Bad],
    %% The pool node checks again (any peer can ask it).
    [?assertEqual({V, {error, {badarg, {max_reply_atoms, V}}}},
                  {V, gen_server:call({actor_pool_node, PN},
                                      {start_pool, ?FUNCTION_NAME, echo, #{max_reply_atoms => V}}, ?ASK_MS)})
     || V <- Bad],
    ?assertNot(lists:keymember(?FUNCTION_NAME, 1, actor_pool:which_pools())),
    with_pool(?FUNCTION_NAME, {thread, true}, #{max_reply_atoms => 1}, fun(P) ->
        ?assertMatch(#{max_reply_atoms := 1, reply_atoms := 0}, actor_pool:stats(P)),
        ?assertEqual({ok, x}, actor_pool:ask(P, <<"term:", (utf8_atom(<<"x">>))/binary>>, ?ASK_MS)),
        ?assertEqual({error, bad_reply}, actor_pool:ask(P, <<"term:", (utf8_atom(<<"y">>))/binary>>, ?ASK_MS)),
        ?assertEqual({ok, {x, x}}, actor_pool:ask(P, <<"term:", 104, 2, (utf8_atom(<<"x">>))/binary,
                                                      (utf8_atom(<<"x">>))/binary>>, ?ASK_MS)),
        ?assertMatch(#{reply_atoms := 1, bad_replies := 1}, actor_pool:stats(P))
    end).

%% ===================================================================
%% Log lines
%% ===================================================================

add_log_handler() ->
    Id = list_to_atom("bad_reply_log_" ++ integer_to_list(erlang:unique_integer([positive]))),
    Tab = ets:new(?MODULE, [public, bag]),
    put(log_tab, Tab),
    ok = logger:add_handler(Id, ?MODULE, #{level => all, config => #{tab => Tab}}),
    Id.

%% Lines the pool node logged about pool Name's refused replies.
lines(Name) ->
    Prefix = "pool " ++ atom_to_list(Name) ++ ":",
    length([T || {T} <- ets:tab2list(get(log_tab)), lists:prefix(Prefix, T),
                 string:find(T, "bad_reply") =/= nomatch]).

log(#{meta := #{cnode := _}, msg := {F, A}}, #{config := #{tab := Tab}}) ->
    ets:insert(Tab, {lists:flatten(io_lib:format(F, A))}),
    ok;
log(_Event, _Config) ->
    ok.
