%% The receptionist's gossip core (actor_receptionist_gossip) at 100
%% simulated members (support/ap_gossip_sim.erl: one process, a seeded
%% model of latency, loss, churn and partitions). The larger runs (300 and
%% 1000 members) are `make bench-sim'.
-module(actor_receptionist_sim_tests).

-include_lib("eunit/include/eunit.hrl").

-define(N, 100).

%% Every change reaches every member and every view ends equal to its
%% origin's registrations.
settled(#{complete := C, changes := C, consistent := true}) -> true;
settled(_) -> false.

no_loss_test_() ->
    {timeout, 120, fun() ->
        R = ap_gossip_sim:run(#{n => ?N, seed => 11}),
        ?assert(settled(R)),
        %% A delta goes to every member at once: one link's latency (at most 1 ms here).
        ?assert(maps:get(max, maps:get(reach_us, R)) =< 1000),
        %% Anti-entropy: two digests out (fanout 2) and two back per member
        %% and round, not one to every member.
        ?assert(maps:get(idle_msgs_per_member_round, R) < 5.0)
    end}.

one_percent_loss_reaches_everyone_within_two_rounds_test_() ->
    {timeout, 120, fun() ->
        R = ap_gossip_sim:run(#{n => ?N, seed => 12, loss => 0.01}),
        ?assert(settled(R)),
        ?assert(maps:get(p99, maps:get(reach_rounds, R)) < 2.0)
    end}.

ten_percent_loss_is_repaired_test_() ->
    {timeout, 120, fun() ->
        R = ap_gossip_sim:run(#{n => ?N, seed => 13, loss => 0.10, tail_rounds => 10}),
        ?assert(settled(R))
    end}.

a_healed_partition_converges_test_() ->
    {timeout, 120, fun() ->
        R = ap_gossip_sim:run(#{n => ?N, seed => 14, partition => {0.1, 3}, tail_rounds => 6}),
        ?assert(settled(R)),
        %% Changes made on either side while cut off reached the other side
        %% within a round of the heal.
        ?assert(is_integer(maps:get(heal_us, R))),
        ?assert(maps:get(heal_us, R) < 1000000)
    end}.

churn_test_() ->
    {timeout, 120, fun() ->
        %% Members that go down lose their registrations everywhere; those
        %% that come back (new incarnations) get everything again.
        R = ap_gossip_sim:run(#{n => ?N, seed => 15, churn => 5}),
        ?assert(settled(R))
    end}.

%% The bytes a member sends a round while idle grow with N, not N^2: ten
%% times the members, about ten times the bytes (the digest lists every
%% member once); the old protocol (a digest to every member) costs about
%% N / (2 * fanout) times that.
anti_entropy_is_linear_test_() ->
    {timeout, 120, fun() ->
        Small = ap_gossip_sim:run(#{n => 10, seed => 16, changes => 10}),
        Big = ap_gossip_sim:run(#{n => ?N, seed => 16, changes => 10}),
        Ratio = maps:get(idle_bytes_per_member_round, Big)
            / maps:get(idle_bytes_per_member_round, Small),
        ?assert(Ratio < 15),
        %% (At 40 members: the old protocol is slow to simulate.)
        New40 = ap_gossip_sim:run(#{n => 40, seed => 16, changes => 10}),
        Old40 = ap_gossip_sim:run(#{n => 40, seed => 16, changes => 10, fanout => all}),
        ?assert(settled(Old40)),
        %% (N - 1) digests against 2 * fanout: ~10 times at 40.
        ?assert(maps:get(idle_bytes_per_member_round, Old40)
                > 5 * maps:get(idle_bytes_per_member_round, New40))
    end}.

%% A seed gives the same run.
deterministic_test_() ->
    {timeout, 120, fun() ->
        Opts = #{n => 30, seed => 17, loss => 0.05, churn => 1},
        A = maps:remove(wall_ms, ap_gossip_sim:run(Opts)),
        B = maps:remove(wall_ms, ap_gossip_sim:run(Opts)),
        ?assertEqual(A, B),
        C = maps:remove(wall_ms, ap_gossip_sim:run(Opts#{seed => 18})),
        ?assertNotEqual(A, C)
    end}.
