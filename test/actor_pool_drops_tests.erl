%% Tells that are dropped are counted in the metrics, by reason, and a tell
%% that finds no pool is logged once per name:
%%
%% - tells to a misspelt pool name, through the rings and by distribution:
%%   the pool node counts them (`no_pool_tells' in node_stats/1, the
%%   metrics' `actor_pool_dropped_tells_total{node=PoolNode,
%%   reason="no_pool"}') and logs one line per name, however many tells;
%% - tells to a service key with no pool: counted here
%%   (actor_pool:no_pool_tells/0, `reason="no_pool"' under this node), one
%%   line per key;
%% - a tell too large for a frame of the pool node (`reason="oversized"')
%%   and one dropped after a same-host ring stayed full for a second
%%   (`reason="ring_full"': the pool node is stopped with SIGSTOP until one
%%   is, and let go).
%%
%% The application runs with a max_frame of 64 KiB here (the floor), so that
%% an oversized tell is a few MiB, not 64. Log lines are taken with a logger
%% handler of this module's.
-module(actor_pool_drops_tests).

-import(ap_support, [wait_until/2]).
-import(ap_test_util, [with_pool/4]).

-include_lib("eunit/include/eunit.hrl").

-export([misspelt_names_by_ring/1, misspelt_names_by_distribution/1,
         service_key_with_no_pool/1, oversized_tell/1, tell_dropped_after_a_full_ring/1]).
%% logger handler callback
-export([log/2]).

-define(WAIT_MS, 30000).
-define(ENV, [{max_frame, 65536}]).
-define(FAMILY, <<"actor_pool_dropped_tells_total">>).
-define(LINES, '$drops_lines').

drops_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(T), {timeout, 120, fun() -> ?MODULE:T(Ctx) end}}
              || T <- [misspelt_names_by_ring, misspelt_names_by_distribution,
                       service_key_with_no_pool, oversized_tell,
                       tell_dropped_after_a_full_ring]]
     end}.

setup() ->
    Old = ap_test_util:set_env(?ENV),
    Ctx = ap_test_util:pool_setup(),
    Ctx#{old => Old}.

cleanup(#{old := Old} = Ctx) ->
    ok = application:set_env(actor_pool, fast_path, true),
    ap_test_util:pool_cleanup(Ctx),
    ap_test_util:restore_env(Old).

%% ===================================================================
%% Cases
%% ===================================================================

misspelt_names_by_ring(#{pool_node := PN}) ->
    misspelt_names(PN, ring).

misspelt_names_by_distribution(#{pool_node := PN}) ->
    misspelt_names(PN, distribution).

%% 5 tells to one misspelt name, 3 to another: 8 counted by the pool node,
%% in node_stats and in the metrics, and one line for each name. Then 3 more
%% to the first name and one to a third: the third's line comes, and still
%% only one for the first (its lines would have come before: one pipe).
misspelt_names(PN, Transport) ->
    case Transport of
        ring -> use_rings();
        distribution -> ok = application:set_env(actor_pool, fast_path, false),
                        ok = actor_pool_dp:refresh()
    end,
    U = integer_to_list(erlang:unique_integer([positive])),
    [A, B, C] = [list_to_atom("ap_misspelt_" ++ X ++ "_" ++ U) || X <- ["a", "b", "c"]],
    with_log(fun() ->
        #{no_pool_tells := S0} = actor_pool:node_stats(PN),
        M0 = sample(?FAMILY, [{"node", PN}, {"reason", "no_pool"}]),
        [ok = actor_pool:tell(A, <<"x">>) || _ <- lists:seq(1, 5)],
        [ok = actor_pool:tell(B, {msg, I}) || I <- lists:seq(1, 3)],
        %% Each case goes the way it says.
        ?assertEqual(Transport, transport(PN)),
        ok = wait_until(fun() -> no_pool_tells(PN) =:= S0 + 8 end, ?WAIT_MS),
        ?assertEqual(M0 + 8, sample(?FAMILY, [{"node", PN}, {"reason", "no_pool"}])),
        LineA = await_line(A),
        _ = await_line(B),
        [?assertNotEqual(nomatch, string:find(LineA, S))
         || S <- ["tell from ", "'" ++ atom_to_list(A) ++ "'", "dropped", "no pool"]],
        [ok = actor_pool:tell(A, <<"again">>) || _ <- lists:seq(1, 3)],
        ok = actor_pool:tell(C, <<"x">>),
        _ = await_line(C),
        ?assertMatch([_], lines_naming(A)),
        ?assertMatch([_], lines_naming(B)),
        ok = wait_until(fun() -> no_pool_tells(PN) =:= S0 + 12 end, ?WAIT_MS),
        ?assertEqual(M0 + 12, sample(?FAMILY, [{"node", PN}, {"reason", "no_pool"}]))
    end).

%% Tells to a key no pool is registered under: counted here, in
%% no_pool_tells/0 and in the metrics under this node, one line for the key.
service_key_with_no_pool(_Ctx) ->
    use_rings(),
    Id = iolist_to_binary(["drops.nokey.", integer_to_list(erlang:unique_integer([positive]))]),
    Key = actor_receptionist:service_key(Id),
    with_log(fun() ->
        C0 = actor_pool:no_pool_tells(),
        M0 = sample(?FAMILY, [{"node", node()}, {"reason", "no_pool"}]),
        [ok = actor_pool:tell(Key, <<"x">>) || _ <- lists:seq(1, 4)],
        ?assertEqual(C0 + 4, actor_pool:no_pool_tells()),
        ?assertEqual(M0 + 4, sample(?FAMILY, [{"node", node()}, {"reason", "no_pool"}])),
        %% logger calls its handlers in the caller: every line is in by now.
        Lines = lines_naming(binary_to_list(Id)),
        ?assertMatch([_], Lines),
        [?assertNotEqual(nomatch, string:find(hd(Lines), S))
         || S <- ["dropped", "no pool is registered"]]
    end).

%% A 4 MiB tell fits neither a ring record nor a frame of 64 KiB: dropped
%% here, counted under reason oversized.
oversized_tell(_Ctx) ->
    use_rings(),
    with_pool(drops_oversized, echo, #{workers => 1}, fun(P) ->
        {ok, <<"warm">>} = actor_pool:ask(P, <<"warm">>),
        #{tells := T0} = actor_pool:oversized(),
        M0 = sample(?FAMILY, [{"node", node()}, {"reason", "oversized"}]),
        ok = actor_pool:tell(P, binary:copy(<<"x">>, 4 * 1024 * 1024)),
        ?assertMatch(#{tells := T1} when T1 =:= T0 + 1, actor_pool:oversized()),
        ?assertEqual(M0 + 1, sample(?FAMILY, [{"node", node()}, {"reason", "oversized"}])),
        ?assertMatch(#{processed := 1}, actor_pool:stats(P))
    end).

%% The pool node stopped (SIGSTOP), a sender of 400 KiB tells fills the
%% request rings and waits a second for room at each tell past that, then
%% drops it: once one is dropped the pool node is let go. The metrics'
%% ring_full count moved as actor_pool_dp's tell_dropped did.
tell_dropped_after_a_full_ring(#{pool_node := PN}) ->
    use_rings(),
    with_pool(drops_ring_full, echo, #{workers => 1, mailbox_limit => 1048576}, fun(P) ->
        {ok, <<"warm">>} = actor_pool:ask(P, <<"warm">>),
        ?assertEqual(ring, transport(PN)),
        D0 = ring_dropped(),
        M0 = sample(?FAMILY, [{"node", node()}, {"reason", "ring_full"}]),
        #{os_pid := OsPid} = actor_cnode:info(actor_pool_node_owner),
        Big = binary:copy(<<"f">>, 400 * 1024),
        Loop = fun L() ->
                       ok = actor_pool:tell(P, Big),
                       case ring_dropped() > D0 of
                           true -> ok;
                           false -> L()
                       end
               end,
        _ = os:cmd("kill -STOP " ++ integer_to_list(OsPid)),
        {Sender, Mref} =
            try
                S = spawn_monitor(Loop),
                ok = wait_until(fun() -> ring_dropped() > D0 end, ?WAIT_MS),
                S
            after
                _ = os:cmd("kill -CONT " ++ integer_to_list(OsPid))
            end,
        receive {'DOWN', Mref, process, Sender, normal} -> ok
        after ?WAIT_MS -> error(sender_stuck)
        end,
        D1 = ring_dropped(),
        ?assert(D1 > D0),
        ?assertEqual(M0 + (D1 - D0), sample(?FAMILY, [{"node", node()}, {"reason", "ring_full"}]))
    end).

%% ===================================================================
%% Helpers
%% ===================================================================

use_rings() ->
    ok = application:set_env(actor_pool, fast_path, true),
    ok = actor_pool_dp:refresh().

no_pool_tells(PN) ->
    maps:get(no_pool_tells, actor_pool:node_stats(PN)).

ring_dropped() ->
    #{counters := #{tell_dropped := D}} = actor_pool_dp:info(),
    D.

%% ring or distribution: how this node reaches pool node PN now.
transport(PN) ->
    #{lanes := Lanes} = actor_pool_dp:info(),
    case [maps:get(transport, L) || #{node := N} = L <- Lanes, N =:= PN] of
        [T] -> T;
        [] -> distribution
    end.

%% The value of Name{Labels} in the metrics (labels in the order rendered).
sample(Name, Labels) ->
    Text = iolist_to_binary(actor_pool_metrics:render()),
    L = iolist_to_binary([Name, "{", lists:join(",", [[K, "=\"", to_list(V), "\""]
                                                      || {K, V} <- Labels]), "} "]),
    case [X || X <- binary:split(Text, <<"\n">>, [global]),
               binary:longest_common_prefix([X, L]) =:= byte_size(L)] of
        [Line] ->
            binary_to_integer(binary:part(Line, byte_size(L), byte_size(Line) - byte_size(L)));
        Other -> error({no_single_sample, L, Other})
    end.

to_list(A) when is_atom(A) -> atom_to_list(A);
to_list(S) -> S.

%% Fun() with every log line, from here on, kept for lines/0.
with_log(Fun) ->
    Handler = list_to_atom("ap_drops_log_" ++ integer_to_list(erlang:unique_integer([positive]))),
    _ = erase(?LINES),
    ok = logger:add_handler(Handler, ?MODULE, #{level => all, config => #{pid => self()}}),
    try Fun()
    after ok = logger:remove_handler(Handler)
    end.

%% The log lines so far, in order.
lines() ->
    receive {drops_line, L} -> put(?LINES, get_lines() ++ [L]), lines()
    after 0 -> get_lines()
    end.

get_lines() ->
    case get(?LINES) of
        undefined -> [];
        Ls -> Ls
    end.

lines_naming(Name) ->
    [L || L <- lines(), string:find(L, quoted(Name)) =/= nomatch].

%% The first line naming Name, waited for.
await_line(Name) ->
    await_line(Name, erlang:monotonic_time(millisecond) + ?WAIT_MS).

await_line(Name, Deadline) ->
    case lines_naming(Name) of
        [L | _] ->
            L;
        [] ->
            receive
                {drops_line, _} = Line -> self() ! Line, await_line(Name, Deadline)
            after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
                error({no_line_naming, Name, lines()})
            end
    end.

quoted(Name) when is_atom(Name) -> "'" ++ atom_to_list(Name) ++ "'";
quoted(Id) -> Id.

-spec log(logger:log_event(), logger:handler_config()) -> ok.
log(#{msg := Msg}, #{config := #{pid := Pid}}) ->
    Pid ! {drops_line, lists:flatten(io_lib:format("~ts", [format(Msg)]))},
    ok.

format({string, S}) -> S;
format({F, A}) when is_list(F) -> io_lib:format(F, A);
format(Other) -> io_lib:format("~0p", [Other]).
