%% The latency histograms in the metrics: each ask's round trip, measured in
%% this BEAM (`actor_pool_ask_duration_seconds'), and each handler call's
%% run time on asks, measured on the pool node
%% (`actor_pool_handler_duration_seconds', stats/1's `handler_time'), per
%% pool:
%%
%% - every ask is counted once, by pid and by name alike, over the rings, by
%%   distribution and to a process-mode pool, in both; tells in neither;
%% - buckets are cumulative, end in `+Inf', and `_count' is that bucket;
%% - asks and calls that sleep 30 ms are all past the 25 ms bound, and their
%%   sum is at least what they slept (thread and process mode);
%% - the whole output passes `promtool check metrics' (Debian's prometheus
%%   package: a missing promtool fails the case);
%% - a stopped pool leaves the ask histograms;
%% - a worker process that writes into its own histogram cannot make its
%%   pool's shrink or wrap.
-module(actor_pool_histogram_tests).

-import(ap_test_util, [with_pool/4, crash_plugin/0]).
-import(ap_support, [wait_until/2]).

-include_lib("eunit/include/eunit.hrl").

-export([every_ask_and_call_is_counted_once/1, slow_calls_land_past_their_bound/1,
         histograms_pass_promtool/1, a_stopped_pool_leaves_the_ask_histograms/1,
         a_worker_process_cannot_shrink_or_wrap_its_handler_times/1]).

-define(ASK, <<"actor_pool_ask_duration_seconds">>).
-define(HANDLER, <<"actor_pool_handler_duration_seconds">>).

histogram_test_() ->
    {setup, fun ap_test_util:pool_setup/0, fun ap_test_util:pool_cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(T), {timeout, 120, fun() -> ?MODULE:T(Ctx) end}}
              || T <- [every_ask_and_call_is_counted_once, slow_calls_land_past_their_bound,
                       histograms_pass_promtool, a_stopped_pool_leaves_the_ask_histograms,
                       a_worker_process_cannot_shrink_or_wrap_its_handler_times]]
     end}.

%% ===================================================================
%% Cases
%% ===================================================================

%% 20 asks by pid and 20 by name, to a thread pool over the rings, one by
%% distribution and a process-mode pool: 40 in each pool's ask histogram
%% and in its handler histogram (stats/1 and the metrics agree). Tells are
%% not timed: 10 of them, handled, leave both at 40.
every_ask_and_call_is_counted_once(#{pool_node := PN}) ->
    [with_pool(Name, echo, Opts, fun(P) ->
         [{ok, <<"a">>} = actor_pool:ask(P, <<"a">>) || _ <- lists:seq(1, 20)],
         [{ok, <<"b">>} = actor_pool:ask(Name, <<"b">>) || _ <- lists:seq(1, 20)],
         [ok = actor_pool:tell(P, <<"t">>) || _ <- lists:seq(1, 10)],
         ok = wait_until(fun() -> maps:get(processed, actor_pool:stats(P)) =:= 50 end, 30000),
         ?assertMatch(#{by_path := #{Path := 50}}, actor_pool:stats(P)),
         #{handler_time := #{counts := Counts, bounds_ns := Bounds, sum_ns := SumNs}} =
             actor_pool:stats(P),
         ?assertEqual(40, lists:sum(Counts)),
         ?assertEqual(length(Bounds) + 1, length(Counts)),
         ?assert(SumNs > 0),
         Text = render(),
         Ask = histogram(Text, ?ASK, Name, PN),
         Handler = histogram(Text, ?HANDLER, Name, PN),
         [begin
              ?assertEqual(40, Count),
              ?assert(Sum > 0)
          end || {_, Sum, Count} <- [Ask, Handler]]
     end)
     || {Name, Opts, Path} <- [{hist_ring, #{workers => 2}, ring},
                               {hist_dist, #{workers => 2, fast_path => false}, dist},
                               {hist_proc, #{workers => 2, isolation => process}, ring}]].

%% Asks whose handler sleeps 30 ms: none in a bucket at or under 25 ms, all
%% 5 counted, and a sum of at least 150 ms; for the ask and for the
%% handler, in thread and in process mode.
slow_calls_land_past_their_bound(#{pool_node := PN}) ->
    [with_pool(Name, crash_plugin(), #{workers => 1, isolation => Iso}, fun(P) ->
         [{ok, ok} = actor_pool:ask(P, {sleep, 30}) || _ <- lists:seq(1, 5)],
         Text = render(),
         [begin
              {Buckets, Sum, Count} = histogram(Text, F, Name, PN),
              ?assertEqual(5, Count),
              ?assertEqual(0, proplists:get_value("0.025", Buckets)),
              ?assert(Sum >= 0.15, {F, Sum})
          end || F <- [?ASK, ?HANDLER]]
     end)
     || {Name, Iso} <- [{hist_slow_thread, thread}, {hist_slow_proc, process}]].

%% The whole output, with both histograms and every drop reason in it,
%% passes promtool.
histograms_pass_promtool(_Ctx) ->
    with_pool(hist_promtool, echo, #{workers => 2}, fun(P) ->
        [{ok, _} = actor_pool:ask(P, <<"x">>) || _ <- lists:seq(1, 10)],
        ok = actor_pool:tell(list_to_atom("hist_misspelt_" ++ integer_to_list(
                                                               erlang:unique_integer([positive]))),
                             <<"lost">>),
        Text = render(),
        [?assertMatch({match, _}, re:run(Text, "^# TYPE " ++ F ++ " histogram$", [multiline]), F)
         || F <- [binary_to_list(?ASK), binary_to_list(?HANDLER)]],
        [?assertMatch({match, _}, re:run(Text, "^actor_pool_dropped_tells_total\\{.*reason=\""
                                         ++ R ++ "\"\\} [0-9]+$", [multiline]), R)
         || R <- ["mailbox_full", "no_pool", "oversized", "ring_full"]],
        ?assertEqual({0, ""}, ap_test_util:promtool_check(Text))
    end).

%% Asked, the pool is in the ask histograms; stopped, it is not.
a_stopped_pool_leaves_the_ask_histograms(#{pool_node := PN}) ->
    {ok, P} = actor_pool:start_pool(hist_stopped, echo, #{workers => 1}),
    {ok, _} = actor_pool:ask(P, <<"x">>),
    ?assertMatch({_, _, 1}, histogram(render(), ?ASK, hist_stopped, PN)),
    ok = actor_pool:stop_pool(P),
    Text = render(),
    ?assertEqual(nomatch, binary:match(Text, <<"pool=\"hist_stopped\"">>)).

%% A plugin in a worker process writes what it likes into its channel,
%% its handler-time histogram too (plugin_hostile.so): huge counts and sums,
%% then zeros, then huge again. The pool's histogram only grows (each
%% bucket, at every look), its sum stops at 2^64 - 1 instead of wrapping,
%% the counts go on from the zeros as the child counts again, and the
%% output still passes promtool.
a_worker_process_cannot_shrink_or_wrap_its_handler_times(_Ctx) ->
    Hostile = {plugin, ap_support:test_bin("plugin_hostile.so")},
    with_pool(hist_hostile, Hostile, #{workers => 1, isolation => process}, fun(P) ->
        Read = fun() ->
                       #{handler_time := #{counts := C, sum_ns := S}} = actor_pool:stats(P),
                       {C, S}
               end,
        [{ok, 3} = actor_pool:ask(P, <<"abc">>) || _ <- [1, 2, 3]],
        R1 = Read(),
        ?assertEqual(3, lists:sum(element(1, R1))),
        Seen = [begin
                    {ok, lied} = actor_pool:ask(P, Lie),
                    Read()
                end || Lie <- [<<"times_high">>, <<"times_zero">>, <<"times_high">>,
                               <<"times_zero">>]],
        {C5, S5} = lists:last(Seen),
        [{ok, 3} = actor_pool:ask(P, <<"abc">>) || _ <- [1, 2]],
        {C6, S6} = Read(),
        Reads = [R1 | Seen] ++ [{C6, S6}],
        [begin
             ?assert(lists:all(fun({X, Y}) -> Y >= X end, lists:zip(A, B)), {A, B}),
             ?assert(SB >= SA, {SA, SB})
         end || {{A, SA}, {B, SB}} <- lists:zip(lists:droplast(Reads), tl(Reads))],
        ?assertEqual(1 bsl 64 - 1, S5),
        ?assertEqual(S5, S6),
        ?assertEqual(lists:sum(C5) + 2, lists:sum(C6)),
        ?assertEqual({0, ""}, ap_test_util:promtool_check(render()))
    end).

%% ===================================================================
%% Helpers
%% ===================================================================

render() ->
    iolist_to_binary(actor_pool_metrics:render()).

%% Family's histogram for pool Name on PN: {[{Le, Cumulative}], Sum, Count},
%% after checking its shape: buckets in ascending le, counts that never go
%% down, +Inf last and equal to _count.
histogram(Text, Family, Name, PN) ->
    Labels = ["pool=\"", atom_to_list(Name), "\",node=\"", atom_to_list(PN), "\""],
    Prefix = iolist_to_binary([Family, "_bucket{", Labels, ",le=\""]),
    Lines = binary:split(Text, <<"\n">>, [global]),
    Buckets = [{binary_to_list(Le), binary_to_integer(V)}
               || L <- Lines, binary:longest_common_prefix([L, Prefix]) =:= byte_size(Prefix),
                  [Le, V] <- [binary:split(binary:part(L, byte_size(Prefix),
                                                       byte_size(L) - byte_size(Prefix)),
                                           <<"\"} ">>)]],
    ?assertMatch([_, _ | _], Buckets),
    {Les, Counts} = lists:unzip(Buckets),
    ?assertEqual("+Inf", lists:last(Les)),
    Finite = [list_to_float(normal_float(Le)) || Le <- lists:droplast(Les)],
    ?assertEqual(lists:usort(Finite), Finite),
    ?assertEqual(lists:sort(Counts), Counts),
    Sum = value(Lines, iolist_to_binary([Family, "_sum{", Labels, "} "])),
    Count = value(Lines, iolist_to_binary([Family, "_count{", Labels, "} "])),
    ?assertEqual(lists:last(Counts), Count),
    {Buckets, Sum, Count}.

normal_float(S) ->
    case lists:member($., S) of
        true -> S;
        false -> S ++ ".0"
    end.

value(Lines, Prefix) ->
    [V] = [binary:part(L, byte_size(Prefix), byte_size(L) - byte_size(Prefix))
           || L <- Lines, binary:longest_common_prefix([L, Prefix]) =:= byte_size(Prefix)],
    try binary_to_integer(V)
    catch error:badarg -> binary_to_float(V)
    end.

