%% The receptionist across a cluster: real BEAM peers (the `peer' module),
%% each running the actor_pool application with its own receptionist C node,
%% connected to each other by distributed Erlang.
%%
%% The test node itself runs no receptionist and is not connected to the
%% peers' cluster: it drives them over the peers' standard_io control
%% channel, so that disconnecting peers from each other is a real partition.
%% Subscribers and refs are processes on the peers (a receptionist C node
%% talks to its own BEAM only). Waits poll with a deadline; listings are
%% compared as sets (refs from different origins arrive in different orders
%% on different nodes). Every peer is stopped (or killed and reaped) by the
%% case that started it, its names leave epmd and its receptionist's
%% snapshot segment leaves /dev/shm.
-module(actor_receptionist_cluster_tests).

-import(ap_support, [wait_until/2, epmd_names/0]).

-include_lib("eunit/include/eunit.hrl").
%% PropEr by its functions: proper.hrl and eunit.hrl both define ?LET.

-export([three_nodes_register_find_subscribe_deregister/0,
         a_stopped_node_takes_its_registrations/0,
         a_killed_node_takes_its_registrations/0,
         refs_on_a_node_that_left_go_too/0,
         a_large_member_leaves_in_one_rebuild/0,
         a_hidden_node_is_no_member_and_its_refs_live_with_its_connection/0,
         receptionist_crash_drops_then_regains/0,
         a_killed_c_node_changes_nothing_for_the_peers/0,
         partition_heals_and_converges/0,
         a_relayed_origin_goes_when_it_dies/0,
         a_network_cut_heals_and_converges/0,
         complete_view_holds_the_first_listing/0,
         a_held_subscription_waits_and_unsubscribe_cancels_it/0,
         bad_options_are_badarg/0,
         cluster_property/0,
         forged_gossip_changes_nothing/0,
         origins_that_are_no_members_cost_nothing/0,
         origin_slots_of_members_that_left_are_reused/0,
         registrations_cost_the_same_with_many_origins/0,
         a_watched_registration_goes_from_every_member/0,
         a_gen_server_named_on_one_member_is_called_from_another/0]).
%% Run on the peers.
-export([forge_member/6, forge_origins/4, footprint/0, fake_relay/2]).

-define(WAIT_MS, 20000).
-define(GOSSIP_MS, 200).

actor_receptionist_cluster_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     [{atom_to_list(Name), {timeout, 180, fun ?MODULE:Name/0}}
      || Name <- [three_nodes_register_find_subscribe_deregister,
                  a_stopped_node_takes_its_registrations,
                  a_killed_node_takes_its_registrations,
                  refs_on_a_node_that_left_go_too,
                  a_large_member_leaves_in_one_rebuild,
                  a_hidden_node_is_no_member_and_its_refs_live_with_its_connection,
                  receptionist_crash_drops_then_regains,
                  a_killed_c_node_changes_nothing_for_the_peers,
                  partition_heals_and_converges,
                  a_relayed_origin_goes_when_it_dies,
                  a_network_cut_heals_and_converges,
                  complete_view_holds_the_first_listing,
                  a_held_subscription_waits_and_unsubscribe_cancels_it,
                  bad_options_are_badarg,
                  cluster_property,
                  forged_gossip_changes_nothing,
                  origins_that_are_no_members_cost_nothing,
                  origin_slots_of_members_that_left_are_reused,
                  registrations_cost_the_same_with_many_origins,
                  a_watched_registration_goes_from_every_member,
                  a_gen_server_named_on_one_member_is_called_from_another]]}.

setup() ->
    %% peer needs this node alive only for names; the cluster is the peers'.
    WasAlive = is_alive(),
    ok = actor_dist:ensure_distributed(),
    WasAlive.

cleanup(WasAlive) ->
    ok = ap_test_util:no_segments_left(),
    case WasAlive of
        true -> ok;
        false -> ok = net_kernel:stop()
    end.

%% ===================================================================
%% Cases
%% ===================================================================

three_nodes_register_find_subscribe_deregister() ->
    with_members(3, fun([A, B, C] = Ms) ->
        K = key(basic),
        Subs = [{M, subscriber(M, K)} || M <- Ms],
        [wait_listing(M, S, K, []) || {M, S} <- Subs],
        RA = ref(A),
        ok = call(A, actor_receptionist, register, [K, RA]),
        converge(Ms, K, [RA]),
        %% find on another node sees it.
        ?assertEqual([RA], find(B, K)),
        RB = ref(B), RC = ref(C),
        ok = call(B, actor_receptionist, register, [K, RB]),
        ok = call(C, actor_receptionist, register, [K, RC]),
        converge(Ms, K, [RA, RB, RC]),
        [wait_listing(M, S, K, [RA, RB, RC]) || {M, S} <- Subs],
        ok = call(B, actor_receptionist, deregister, [K, RB]),
        converge(Ms, K, [RA, RC]),
        [wait_listing(M, S, K, [RA, RC]) || {M, S} <- Subs],
        %% Every subscriber saw each change once: no listing repeats.
        [?assertEqual(no_repeats, repeats(listings(M, S, K))) || {M, S} <- Subs],
        [?assertMatch(#{complete := true}, call(M, actor_receptionist, status, [])) || M <- Ms],
        #{members := Members} = call(A, actor_receptionist, status, []),
        ?assertEqual(lists:sort([node_of(B), node_of(C)]), Members),
        %% The gossip counters (the metrics') saw the traffic: each member
        %% sent and took in messages and bytes, and took in whole states.
        [?assertMatch(#{gossip := #{sent := GS, sent_bytes := GSB, received := GR,
                                    received_bytes := GRB, full_syncs := GF, member_drops := 0}}
                        when GS > 0 andalso GSB > GS andalso GR > 0 andalso GRB > GR andalso GF >= 2,
                      call(M, actor_receptionist, status, [])) || M <- Ms]
    end).

a_stopped_node_takes_its_registrations() ->
    removal(fun(Peer) -> peer:stop(Peer) end).

a_killed_node_takes_its_registrations() ->
    removal(fun(Peer) ->
                    OsPid = call(Peer, os, getpid, []),
                    _ = os:cmd("kill -9 " ++ OsPid),
                    wait_until(fun() -> not ap_support:os_pid_alive(list_to_integer(OsPid)) end,
                               ?WAIT_MS)
            end).

removal(Stop) ->
    with_members(2, fun([A, C] = Ms) ->
        K = key(removal),
        SA = subscriber(A, K), SC = subscriber(C, K),
        RA = ref(A),
        ok = call(A, actor_receptionist, register, [K, RA]),
        {B, BName} = start_member(),
        try
            mesh([A, B, C]),
            RB1 = ref(B), RB2 = ref(B),
            ok = call(B, actor_receptionist, register, [K, RB1]),
            ok = call(B, actor_receptionist, register, [K, RB2]),
            converge([A, B, C], K, [RA, RB1, RB2]),
            #{gossip := #{member_drops := Drops0}} = call(A, actor_receptionist, status, []),
            Stop(B),
            %% Gone everywhere; subscribers got the smaller listing.
            converge(Ms, K, [RA]),
            %% and counted as a member that left.
            wait_until(fun() ->
                               #{gossip := #{member_drops := D}} = call(A, actor_receptionist, status, []),
                               D =:= Drops0 + 1
                       end, ?WAIT_MS),
            wait_listing(A, SA, K, [RA]),
            wait_listing(C, SC, K, [RA])
        after
            stop_member(B)
        end,
        %% It comes back (same name), and its new registrations appear.
        {B2, BName} = start_member(BName),
        try
            mesh([A, B2, C]),
            RB3 = ref(B2),
            ok = call(B2, actor_receptionist, register, [K, RB3]),
            converge([A, B2, C], K, [RA, RB3]),
            wait_listing(A, SA, K, [RA, RB3])
        after
            stop_member(B2)
        end,
        converge(Ms, K, [RA])
    end).

refs_on_a_node_that_left_go_too() ->
    with_members(2, fun([A, C] = Ms) ->
        K = key(refs_elsewhere),
        {B, _} = start_member(),
        try
            mesh([A, B, C]),
            %% A registers a process that lives on B.
            RonB = ref(B), RA = ref(A),
            ok = call(A, actor_receptionist, register, [K, RonB]),
            ok = call(A, actor_receptionist, register, [K, RA]),
            converge([A, B, C], K, [RonB, RA]),
            peer:stop(B),
            converge(Ms, K, [RA])
        after
            stop_member(B)
        end
    end).

%% Over 4096 refs (and a quarter of what stays) of a member that leaves are
%% dropped in bulk: the snapshot is rebuilt once, and the subscribers'
%% listings go out after it. Lookups on the rest stay right.
a_large_member_leaves_in_one_rebuild() ->
    with_members(1, fun([A]) ->
        K = key(bulk_watched), Mine = key(bulk_mine),
        S = subscriber(A, K),
        RA = ref(A),
        ok = call(A, actor_receptionist, register, [Mine, RA]),
        ok = call(A, actor_receptionist, register, [K, RA]),
        {B, _} = start_member(),
        try
            mesh([A, B]),
            RB = ref(B),
            Keys = [key({bulk, I}) || I <- lists:seq(1, 6000)],
            ok = call(B, erlang, apply,
                      [fun() -> [ok = actor_receptionist:register(Ki, RB) || Ki <- [K | Keys]], ok end, []]),
            converge([A], lists:last(Keys), [RB]),
            converge([A], K, [RA, RB]),
            wait_listing(A, S, K, [RA, RB]),
            #{shm_rebuilds := Rebuilds0} = call(A, actor_receptionist, stats, []),
            peer:stop(B),
            wait_listing(A, S, K, [RA]),
            %% The listing left after the rebuild: lookups agree at once.
            ?assertEqual([RA], lookup(A, K)),
            ?assertEqual([], lookup(A, hd(Keys))),
            ?assertEqual([], lookup(A, lists:last(Keys))),
            ?assertEqual([RA], lookup(A, Mine)),
            ?assertMatch(#{refs := 2, shm_state := live}, call(A, actor_receptionist, stats, [])),
            #{shm_rebuilds := Rebuilds1} = call(A, actor_receptionist, stats, []),
            ?assertEqual(Rebuilds0 + 1, Rebuilds1)
        after
            stop_member(B)
        end
    end).

%% A hidden BEAM running the application is no member: it follows the
%% members it connects to (their registrations, and what they relay, show
%% in its find/lookup/listings), and what it registers is also made on every
%% member it follows, so it lives as long as it is connected to one of them
%% (and comes back when it reconnects). Refs of processes on it registered
%% by a member go when that member's connection to it goes.
a_hidden_node_is_no_member_and_its_refs_live_with_its_connection() ->
    with_members(2, fun([A, C] = Ms) ->
        K = key(hidden),
        {H, _} = start_member(peer:random_name(rcpt_hidden), ["-hidden"]),
        try
            NH = node_of(H),
            SH = subscriber(H, K),
            true = call(H, net_kernel, connect_node, [node_of(A)]),
            wait_until(fun() -> maps:get(members, call(H, actor_receptionist, status, [])) =:= [node_of(A)]
                                    andalso maps:get(complete, call(H, actor_receptionist, status, []))
                       end, ?WAIT_MS),
            RonH = ref(H), RA = ref(A), RC = ref(C), Mine = ref(H),
            ok = call(A, actor_receptionist, register, [K, RonH]),
            ok = call(A, actor_receptionist, register, [K, RA]),
            ok = call(C, actor_receptionist, register, [K, RC]),
            %% Registered on H: made on A too (the member it follows).
            ok = call(H, actor_receptionist, register, [K, Mine]),
            converge(Ms ++ [H], K, [RonH, RA, RC, Mine]),
            wait_listing(H, SH, K, [RonH, RA, RC, Mine]),
            %% No member counts H, and H counts none as its members' peer.
            [?assertNot(lists:member(NH, maps:get(members, call(M, actor_receptionist, status, []))))
             || M <- Ms],
            ?assert(lists:member(NH, call(A, erlang, nodes, [hidden]))),
            true = call(H, net_kernel, connect_node, [node_of(C)]),
            wait_until(fun() -> lists:sort(maps:get(members, call(H, actor_receptionist, status, [])))
                                    =:= lists:sort([node_of(A), node_of(C)]) end, ?WAIT_MS),
            %% The connection to A goes: A's registration of a process on H
            %% goes everywhere; H's own stays, held by C (which got it when
            %% H started following it).
            true = call(A, erlang, disconnect_node, [NH]),
            converge(Ms ++ [H], K, [RA, RC, Mine]),
            wait_listing(H, SH, K, [RA, RC, Mine]),
            %% And its last connection: its registration leaves the cluster.
            true = call(C, erlang, disconnect_node, [NH]),
            converge(Ms, K, [RA, RC]),
            %% It reconnects: its registration is made again.
            true = call(H, net_kernel, connect_node, [node_of(A)]),
            converge(Ms ++ [H], K, [RA, RC, Mine])
        after
            stop_member(H)
        end
    end).

receptionist_crash_drops_then_regains() ->
    with_members(3, fun([A, B, _C] = Ms) ->
        K = key(crash),
        SA = subscriber(A, K),
        RA = ref(A), RB = ref(B),
        ok = call(A, actor_receptionist, register, [K, RA]),
        ok = call(B, actor_receptionist, register, [K, RB]),
        converge(Ms, K, [RA, RB]),
        wait_listing(A, SA, K, [RA, RB]),
        #{incarnation := Inc0} = call(B, actor_receptionist, status, []),
        Server = call(B, erlang, whereis, [actor_receptionist_server]),
        true = call(B, erlang, exit, [Server, kill]),
        %% A new incarnation on B; the peers dropped and regained its refs.
        wait_until(fun() ->
                           case call(B, actor_receptionist, status, []) of
                               #{incarnation := I} -> I =/= Inc0;
                               _ -> false
                           end
                   end, ?WAIT_MS),
        converge(Ms, K, [RA, RB]),
        wait_listing(A, SA, K, [RA, RB]),
        Ls = listings(A, SA, K),
        ?assertEqual(no_repeats, repeats(Ls)),
        %% In between, A's subscriber saw B's ref go (then come back).
        ?assert(lists:member(lists:sort([RA]), Ls)),
        [?assertEqual(lists:sort([RA, RB]), lists:sort(lookup(M, K))) || M <- Ms],
        [?assertEqual(2, length(lookup(M, K))) || M <- Ms]
    end).

a_killed_c_node_changes_nothing_for_the_peers() ->
    with_members(2, fun([A, B] = Ms) ->
        K = key(cnode_kill),
        SA = subscriber(A, K),
        RB = ref(B),
        ok = call(B, actor_receptionist, register, [K, RB]),
        converge(Ms, K, [RB]),
        wait_listing(A, SA, K, [RB]),
        RN = call(B, actor_receptionist, receptionist_node, []),
        #{os_pid := OsPid} = call(B, actor_cnode, info, [actor_receptionist_owner]),
        _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        %% B's node comes back with B's own registrations and A's.
        RA = ref(A),
        ok = call(A, actor_receptionist, register, [K, RA]),
        wait_until(fun() ->
                           case call(B, actor_cnode, info, [actor_receptionist_owner]) of
                               #{status := up, os_pid := P} -> P =/= OsPid;
                               _ -> false
                           end
                   end, ?WAIT_MS),
        ?assertEqual(RN, call(B, actor_receptionist, receptionist_node, [])),
        converge(Ms, K, [RA, RB]),
        %% A never saw B's ref go.
        ?assertNot(lists:member([], listings(A, SA, K) -- [hd(listings(A, SA, K))]))
    end).

partition_heals_and_converges() ->
    with_members(3, fun([A, B, C] = Ms) ->
        K = key(partition),
        RA = ref(A), RB = ref(B), RC = ref(C),
        [ok = call(M, actor_receptionist, register, [K, R]) || {M, R} <- [{A, RA}, {B, RB}, {C, RC}]],
        converge(Ms, K, [RA, RB, RC]),
        %% Cut A from B; both still reach C, which relays.
        true = call(A, erlang, disconnect_node, [node_of(B)]),
        wait_until(fun() -> not lists:member(node_of(B), call(A, erlang, nodes, [])) end, ?WAIT_MS),
        {RA2, RB2} = change_both_sides_while_cut(Ms, K, [RA, RB, RC]),
        %% Heal.
        true = call(A, net_kernel, connect_node, [node_of(B)]),
        ok = call(C, actor_receptionist, deregister, [K, RC]),
        converge(Ms, K, [RA, RA2, RB2]),
        wait_until(fun() ->
                           lists:all(fun(M) ->
                                             maps:get(complete, call(M, actor_receptionist, status, []))
                                     end, Ms)
                   end, ?WAIT_MS),
        #{members := MembersA} = call(A, actor_receptionist, status, []),
        ?assertEqual(lists:sort([node_of(B), node_of(C)]), MembersA)
    end).

%% A chain B - A - C (B and C never connected): B learns C's registrations
%% through A, and when C dies they go on B too and stay gone (relays are one
%% hop: a relayed origin is never relayed back).
a_relayed_origin_goes_when_it_dies() ->
    Started = [start_member() || _ <- [a, b, c]],
    [A, B, C] = Ms = [P || {P, _} <- Started],
    try
        [NA, NB, NC] = [node_of(P) || P <- Ms],
        true = call(A, net_kernel, connect_node, [NB]),
        true = call(A, net_kernel, connect_node, [NC]),
        [wait_until(fun() ->
                            case call(P, actor_receptionist, status, []) of
                                #{complete := true, members := Want} -> true;
                                _ -> false
                            end
                    end, ?WAIT_MS) || {P, Want} <- [{A, lists:sort([NB, NC])}, {B, [NA]}, {C, [NA]}]],
        K = key(relay),
        RC = ref(C), RB = ref(B),
        ok = call(C, actor_receptionist, register, [K, RC]),
        ok = call(B, actor_receptionist, register, [K, RB]),
        converge(Ms, K, [RC, RB]),
        ?assertNot(lists:member(NC, call(B, erlang, nodes, []))),
        stop_member(C),
        converge([A, B], K, [RB]),
        %% Observed for five gossip rounds: C's ref does not come back.
        Until = erlang:monotonic_time(millisecond) + 5 * ?GOSSIP_MS,
        Watch = fun W() ->
                        ?assertEqual([[RB], [RB]], [lookup(M, K) || M <- [A, B]]),
                        erlang:monotonic_time(millisecond) < Until andalso
                            begin receive after ?GOSSIP_MS div 4 -> ok end, W() end
                end,
        _ = Watch(),
        ?assertNot(maps:is_key(NC, maps:get(origins, call(B, actor_receptionist, status, []))))
    after
        [stop_member(P) || P <- Ms]
    end.

%% A real cut: three members in network namespaces of their own, linked
%% pairwise by veth pairs with static routes (no forwarding), so taking the
%% A-B link down partitions A from B while C still reaches both. Needs root
%% and iproute2 (`ip netns'); ACTOR_POOL_NO_NETNS=1 turns the case into a
%% no-op for a machine without them, on purpose and visibly.
a_network_cut_heals_and_converges() ->
    case os:getenv("ACTOR_POOL_NO_NETNS") of
        "1" ->
            io:format(user, "~nnetwork-namespace case not run (ACTOR_POOL_NO_NETNS=1)~n", []);
        _ ->
            Net = netns_up(),
            try
                network_cut(Net)
            after
                netns_down(Net)
            end
    end.

network_cut(#{ns := [_, _, _] = Nss} = Net) ->
    Started = [start_member_in(Ns, Net) || Ns <- Nss],
    [A, B, C] = Ms = [P || {P, _} <- Started],
    try
        [?assertMatch([_, "10.78.0." ++ _], string:split(atom_to_list(node_of(P)), "@")) || P <- Ms],
        mesh(Ms),
        K = key(netcut),
        RA = ref(A), RB = ref(B), RC = ref(C),
        [ok = call(M, actor_receptionist, register, [K, R]) || {M, R} <- [{A, RA}, {B, RB}, {C, RC}]],
        converge(Ms, K, [RA, RB, RC]),
        link(Net, ab, down),
        %% Distribution notices by its ticks (net_ticktime 2 s here).
        wait_until(fun() -> not lists:member(node_of(B), call(A, erlang, nodes, [])) end, ?WAIT_MS),
        ?assert(lists:member(node_of(B), call(C, erlang, nodes, []))),
        {RA2, RB2} = change_both_sides_while_cut(Ms, K, [RA, RB, RC]),
        link(Net, ab, up),
        true = call(A, net_kernel, connect_node, [node_of(B)]),
        ok = call(A, actor_receptionist, deregister, [K, RA]),
        converge(Ms, K, [RA2, RB2, RC]),
        wait_until(fun() ->
                           lists:all(fun(M) ->
                                             #{complete := Co, members := Mem} =
                                                 call(M, actor_receptionist, status, []),
                                             Co andalso length(Mem) =:= 2
                                     end, Ms)
                   end, ?WAIT_MS)
    after
        [stop_member(P) || P <- Ms]
    end.

netns_up() ->
    Tag = integer_to_list(list_to_integer(os:getpid()) rem 100000),
    Ns = ["apns" ++ Tag ++ X || X <- ["a", "b", "c"]],
    Addr = fun(I) -> "10.78.0." ++ integer_to_list(I) end,
    %% Links: {Name, I, J, Subnet}: veth "apv<Tag><x><y>" between ns I and J.
    Links = [{ab, 1, 2, "10.79.1."}, {ac, 1, 3, "10.79.2."}, {bc, 2, 3, "10.79.3."}],
    Net = #{ns => Ns, addr => Addr, tag => Tag, links => Links},
    try
        [sh("ip netns add " ++ N) || N <- Ns],
        [begin
             sh(in(N, "ip link set lo up")),
             sh(in(N, "ip addr add " ++ Addr(I) ++ "/32 dev lo"))
         end || {I, N} <- lists:zip([1, 2, 3], Ns)],
        [begin
             {DevI, DevJ} = devs(Net, L),
             sh("ip link add " ++ DevI ++ " type veth peer name " ++ DevJ),
             sh("ip link set " ++ DevI ++ " netns " ++ lists:nth(I, Ns)),
             sh("ip link set " ++ DevJ ++ " netns " ++ lists:nth(J, Ns)),
             sh(in(lists:nth(I, Ns), "ip addr add " ++ Sub ++ "1/30 dev " ++ DevI)),
             sh(in(lists:nth(J, Ns), "ip addr add " ++ Sub ++ "2/30 dev " ++ DevJ)),
             link(Net, L, up)
         end || {L, I, J, Sub} <- Links],
        Net
    catch
        C:R:St ->
            netns_down(Net),
            erlang:raise(C, R, St)
    end.

devs(#{tag := Tag}, Name) ->
    {"apv" ++ Tag ++ atom_to_list(Name), "apw" ++ Tag ++ atom_to_list(Name)}.

%% Both ends of link Name up (with the routes over it) or down.
link(#{ns := Ns, addr := Addr, links := Links} = Net, Name, UpDown) ->
    {Name, I, J, Sub} = lists:keyfind(Name, 1, Links),
    {DevI, DevJ} = devs(Net, Name),
    Updown = atom_to_list(UpDown),
    sh(in(lists:nth(I, Ns), "ip link set " ++ DevI ++ " " ++ Updown)),
    sh(in(lists:nth(J, Ns), "ip link set " ++ DevJ ++ " " ++ Updown)),
    case UpDown of
        up ->
            sh(in(lists:nth(I, Ns), "ip route replace " ++ Addr(J) ++ "/32 via " ++ Sub ++ "2")),
            sh(in(lists:nth(J, Ns), "ip route replace " ++ Addr(I) ++ "/32 via " ++ Sub ++ "1"));
        down ->
            ok
    end.

%% Kill whatever still runs in the namespaces (their epmds: erl started
%% one in each), then remove them; the veths go with them.
netns_down(#{ns := Ns}) ->
    [begin
         Pids = string:lexemes(os:cmd("ip netns pids " ++ N ++ " 2>/dev/null"), "\n"),
         _ = [os:cmd("kill -9 " ++ P) || P <- Pids],
         _ = os:cmd("ip netns del " ++ N ++ " 2>/dev/null")
     end || N <- Ns],
    ok.

in(Ns, Cmd) -> "ip netns exec " ++ Ns ++ " " ++ Cmd.

sh(Cmd) ->
    case string:trim(os:cmd(Cmd ++ " 2>&1; echo \"rc=$?\"")) of
        "rc=0" -> ok;
        Out ->
            case lists:suffix("rc=0", Out) of
                true -> ok;
                false -> error({command_failed, Cmd, Out})
            end
    end.

%% A member whose BEAM (and so its C nodes and epmd) runs in namespace Ns,
%% named after the address of that namespace.
start_member_in(Ns, #{ns := Nss, addr := Addr}) ->
    I = length(lists:takewhile(fun(N) -> N =/= Ns end, Nss)) + 1,
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE, ap_test_util]]),
    {ok, Peer, _} =
        peer:start(#{name => list_to_atom(Ns), host => Addr(I), longnames => true,
                     exec => {os:find_executable("ip"), ["netns", "exec", Ns, os:find_executable("erl")]},
                     connection => standard_io,
                     args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                              "-connect_all", "false",
                              "-kernel", "prevent_overlapping_partitions", "false",
                              "-kernel", "net_ticktime", "2",
                              "-pa" | Paths]}),
    ok = call(Peer, application, load, [actor_pool]),
    ok = call(Peer, application, set_env, [actor_pool, pool_node, false]),
    ok = call(Peer, application, set_env, [actor_pool, gossip_interval_ms, ?GOSSIP_MS]),
    ok = call(Peer, application, set_env, [actor_pool, receptionist_shm_mb, 16]),
    {ok, _} = call(Peer, application, ensure_all_started, [actor_pool]),
    %% Its epmd is the namespace's own: netns_down kills it. Its segment is
    %% in our /dev/shm (ip netns exec keeps the IPC namespace).
    put({member, Peer}, []),
    put({segment, Peer}, ap_test_util:segment(call(Peer, actor_receptionist, receptionist_node, []))),
    own_segment(get({segment, Peer})),
    {Peer, Ns}.

complete_view_holds_the_first_listing() ->
    with_members(2, fun([A, B] = Ms) ->
        K = key(complete),
        Refs = [ref(A) || _ <- lists:seq(1, 200)],
        [ok = call(A, actor_receptionist, register, [K, R]) || R <- Refs],
        converge(Ms, K, Refs),
        %% A fresh member: its first complete-view listing already has
        %% every ref, where a plain subscription may start empty.
        {D, _} = start_member(),
        try
            true = call(D, net_kernel, connect_node, [node_of(A)]),
            true = call(D, net_kernel, connect_node, [node_of(B)]),
            S = call(D, ap_test_util, spawn_collector, []),
            ok = call(D, actor_receptionist, subscribe, [K, S, #{complete => true}]),
            wait_until(fun() -> listings(D, S, K) =/= [] end, ?WAIT_MS),
            [First | _] = listings(D, S, K),
            ?assertEqual(lists:sort(Refs), First),
            ?assertMatch(#{complete := true, syncing := []}, call(D, actor_receptionist, status, []))
        after
            stop_member(D)
        end
    end).

%% A visible node whose receptionist never answers keeps the view
%% incomplete: held subscriptions wait (no listing at all), an unsubscribe
%% cancels one, and the rest get their first listing once it is complete.
a_held_subscription_waits_and_unsubscribe_cancels_it() ->
    with_members(1, fun([A]) ->
        K = key(held),
        Paths = [filename:dirname(code:which(?MODULE))],
        {ok, D, DNode} = peer:start(#{name => peer:random_name(rcpt_mute), connection => standard_io,
                                      args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                                               "-connect_all", "false", "-pa" | Paths]}),
        try
            %% A process under the receptionist server's name that answers
            %% nothing.
            _ = call(D, erlang, apply,
                     [fun() ->
                              P = spawn(fun() -> receive never -> ok end end),
                              true = register(actor_receptionist_server, P),
                              P
                      end, []]),
            true = call(A, net_kernel, connect_node, [DNode]),
            wait_until(fun() ->
                               maps:get(syncing, call(A, actor_receptionist, status, [])) =:= [DNode]
                       end, ?WAIT_MS),
            ?assertMatch(#{complete := false}, call(A, actor_receptionist, status, [])),
            S1 = call(A, ap_test_util, spawn_collector, []),
            S2 = call(A, ap_test_util, spawn_collector, []),
            ok = call(A, actor_receptionist, subscribe, [K, S1, #{complete => true}]),
            ok = call(A, actor_receptionist, subscribe, [K, S2, #{complete => true}]),
            ok = call(A, actor_receptionist, unsubscribe, [K, S2]),
            R = ref(A),
            ok = call(A, actor_receptionist, register, [K, R]),
            ok = call(A, ap_test_util, rcpt_barrier, []),
            ?assertEqual([], listings(A, S1, K)),
            %% The mute node goes: the view is complete.
            peer:stop(D),
            wait_listing(A, S1, K, [R]),
            ?assertEqual([[R]], listings(A, S1, K)),
            ok = call(A, ap_test_util, rcpt_barrier, []),
            ?assertEqual([], listings(A, S2, K)),
            ?assertMatch(#{complete := true, syncing := []}, call(A, actor_receptionist, status, []))
        after
            catch peer:stop(D),
            wait_gone([DNode])
        end
    end).

bad_options_are_badarg() ->
    with_members(1, fun([A]) ->
        S = ref(A),
        ?assertEqual({error, {badarg, {opts, #{complete => maybe}}}},
                     call(A, actor_receptionist, subscribe, [k, S, #{complete => maybe}])),
        ?assertEqual({error, {badarg, {opts, nope}}},
                     call(A, actor_receptionist, subscribe, [k, S, nope])),
        ?assertEqual({error, {badarg, {gossip_interval_ms, 0}}},
                     call(A, actor_receptionist_sup, start_link, [#{gossip_interval_ms => 0}])),
        ?assertEqual({error, {badarg, {gossip_fanout, 0}}},
                     call(A, actor_receptionist_sup, start_link, [#{gossip_fanout => 0}])),
        ?assertMatch(#{complete := true, members := []}, call(A, actor_receptionist, status, []))
    end).

%% Random registrations and deregistrations on 3 nodes, of processes on all
%% of them; once quiet, every node's view equals the union of what each
%% node still has registered locally.
cluster_property() ->
    with_members(3, fun(Ms) ->
        %% Few keys and refs, so that one ref under one key is often held by
        %% several nodes at once (the C node holds it once for all).
        Refs = list_to_tuple([ref(M) || M <- Ms]),
        Counter = counters:new(1, []),
        %% Now and then a receptionist C node is killed mid-sequence: its
        %% BEAM replays its own registrations and what it learnt.
        Gen = proper_types:list({proper_types:frequency([{10, reg}, {10, dereg}, {1, kill_cnode}]),
                                 proper_types:range(1, 3),
                                 proper_types:range(1, 2), proper_types:range(1, tuple_size(Refs))}),
        Prop = proper:forall(Gen, fun(Ops) ->
                           counters:add(Counter, 1, 1),
                           Case = counters:get(Counter, 1),
                           Keys = [key({prop, Case, I}) || I <- [1, 2]],
                           Model = lists:foldl(
                                     fun({kill_cnode, N, _, _}, Acc) ->
                                             M = lists:nth(N, Ms),
                                             case call(M, actor_cnode, info, [actor_receptionist_owner]) of
                                                 #{os_pid := OsPid} when is_integer(OsPid) ->
                                                     _ = os:cmd("kill -9 " ++ integer_to_list(OsPid));
                                                 _ ->
                                                     down_already
                                             end,
                                             Acc;
                                        ({Op, N, KI, RI}, Acc) ->
                                             M = lists:nth(N, Ms),
                                             K = lists:nth(KI, Keys),
                                             R = element(RI, Refs),
                                             ok = call(M, actor_receptionist,
                                                       case Op of reg -> register; dereg -> deregister end,
                                                       [K, R]),
                                             case Op of
                                                 reg -> sets:add_element({N, K, R}, Acc);
                                                 dereg -> sets:del_element({N, K, R}, Acc)
                                             end
                                     end, sets:new([{version, 2}]), Ops),
                           lists:all(fun(K) ->
                                             Want = lists:usort([R || {_, K2, R} <- sets:to_list(Model), K2 =:= K]),
                                             converged(Ms, K, Want)
                                     end, Keys)
                       end),
        ?assert(proper:quickcheck(Prop, [{numtests, 40}, {max_size, 40}, quiet,
                                         {on_output, fun(F, A) -> io:format(user, F, A) end}]))
    end).

%% ===================================================================
%% Gossip trusts only what it can check
%% ===================================================================

%% A process on a third node C (not a receptionist) sends A's server and
%% its own node's messages that claim to be B's server's: the older
%% protocol's, which name B's server by its pid (a state without B's
%% registration, a delta that removes it, a hello, a digest), this
%% protocol's on aliases it made up (a state, a delta, a digest, a
%% welcome, an ask), and hellos that would have A or C welcome it. None
%% changes what A or C holds of B: their subscribers see B's registration
%% stay, then B's next real change; each message on a made-up alias is
%% counted as rejected.
forged_gossip_changes_nothing() ->
    with_members(3, fun([A, B, C] = Ms) ->
        K = key(forged),
        {service_key, Id} = K,
        RB = ref(B),
        ok = call(B, actor_receptionist, register, [K, RB]),
        converge(Ms, K, [RB]),
        Watched = [{M, subscriber(M, K)} || M <- [A, C]],
        [wait_listing(M, S, K, [RB]) || {M, S} <- Watched],
        #{incarnation := Inc, version := Ver} = call(B, actor_receptionist, status, []),
        PidB = call(B, erlang, whereis, [actor_receptionist_server]),
        Rejected = fun(M) ->
                           #{gossip := G} = call(M, actor_receptionist, status, []),
                           maps:get(rejected, G, 0)
                   end,
        R0 = [Rejected(M) || M <- [A, C]],
        %% Returns once each target's server has handled them all.
        N = call(C, ?MODULE, forge_member, [[node_of(A), node_of(C)], PidB, Inc, Ver, Id, RB]),
        [ok = call(M, ap_test_util, rcpt_barrier, []) || M <- [A, C]],
        [?assertEqual([RB], lookup(M, K)) || M <- [A, C]],
        %% B's own next change comes through as ever.
        RB2 = ref(B),
        ok = call(B, actor_receptionist, register, [K, RB2]),
        converge(Ms, K, [RB, RB2]),
        [begin
             wait_listing(M, S, K, [RB, RB2]),
             ?assertEqual([lists:sort([RB]), lists:sort([RB, RB2])], listings(M, S, K))
         end || {M, S} <- Watched],
        [?assert(Rejected(M) >= R + N) || {M, R} <- lists:zip([A, C], R0)]
    end).

%% States of made-up origins, "relayed" by member B (by its server's pid,
%% older protocol) or on made-up aliases (this protocol, names as
%% binaries), and digests that list them: A makes no table and no origin
%% slot in its C node for any, holds none of them, and for the binaries no
%% atom either. (An atom in any message is made by the runtime when it
%% decodes the message, before any code sees it: the older protocol's
%% names cost their atoms whoever takes them, which is why names travel as
%% binaries now.)
origins_that_are_no_members_cost_nothing() ->
    with_members(2, fun([A, B]) ->
        PidB = call(B, erlang, whereis, [actor_receptionist_server]),
        F0 = call(A, ?MODULE, footprint, []),
        N1 = call(B, ?MODULE, forge_origins, [node_of(A), PidB, old, 1000]),
        F1 = call(A, ?MODULE, footprint, []),
        N2 = call(B, ?MODULE, forge_origins, [node_of(A), PidB, new, 1000]),
        F2 = call(A, ?MODULE, footprint, []),
        [begin
             ?assert(maps:get(tables, Fb) - maps:get(tables, Fa) < 10),
             ?assertEqual(maps:get(cnode_origins, Fa), maps:get(cnode_origins, Fb)),
             ?assertEqual(maps:get(origins, Fa), maps:get(origins, Fb))
         end || {Fa, Fb} <- [{F0, F1}, {F1, F2}]],
        ?assert(maps:get(atoms, F2) - maps:get(atoms, F1) < 10),
        ?assert(maps:get(rejected, F2) >= maps:get(rejected, F0) + N1 + N2)
    end).

%% The C node's origin slots are those of the members it holds: one that
%% leaves gives its slot back, and a member that comes later (another
%% name) takes it.
origin_slots_of_members_that_left_are_reused() ->
    with_members(1, fun([A]) ->
        K = key(slots),
        ?assertMatch(#{origins := 0}, call(A, actor_receptionist, stats, [])),
        [begin
             {B, _} = start_member(),
             try
                 mesh([A, B]),
                 RB = ref(B),
                 ok = call(B, actor_receptionist, register, [K, RB]),
                 converge([A], K, [RB]),
                 ?assertMatch(#{origins := 1}, call(A, actor_receptionist, stats, []))
             after
                 stop_member(B)
             end,
             converge([A], K, []),
             wait_until(fun() -> maps:get(origins, call(A, actor_receptionist, stats, [])) =:= 0 end,
                        ?WAIT_MS)
         end || _ <- [1, 2, 3]]
    end).

%% Member A holds 10,000 origins, relayed to it by member F (a plain BEAM
%% whose receptionist server is the fake_relay/2 below: it speaks the
%% protocol, and lists the origins as its direct ones), each with one
%% registration, and member B's. A registration on A, and one of B's
%% reaching A, cost A's server about what they cost with no origin: the
%% work is counted in reductions, under a bound that a walk over the
%% origins per registration passes by ten times; the whole case also has a
%% deadline a hundred times what it takes.
registrations_cost_the_same_with_many_origins() ->
    NOrigins = 10000, NRegs = 2000,
    with_members(2, fun([A, B] = Ms) ->
        Paths = [filename:dirname(code:which(M)) || M <- [?MODULE, ap_test_util]],
        {ok, F, FNode} = peer:start(#{name => peer:random_name(rcpt_relay), connection => standard_io,
                                      args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                                               "-connect_all", "false", "-pa" | Paths]}),
        try
            T0 = erlang:monotonic_time(millisecond),
            Names = [iolist_to_binary(io_lib:format("relayed~b@nowhere", [I]))
                     || I <- lists:seq(1, NOrigins)],
            _ = call(F, erlang, spawn, [?MODULE, fake_relay, [node_of(A), Names]]),
            true = call(F, net_kernel, connect_node, [node_of(A)]),
            wait_until(fun() ->
                               case call(A, actor_receptionist, status, []) of
                                   #{origins := Os} -> map_size(Os) >= NOrigins + 2;
                                   {error, timeout} -> false
                               end
                       end, 120000),
            ?assertMatch(#{origins := NOrigins}, call(A, actor_receptionist, stats, [])),
            ?assertEqual([call(F, erlang, whereis, [fake_relay_ref])],
                         lookup(A, actor_receptionist:service_key(<<"relay.", (lists:last(Names))/binary>>))),
            Server = call(A, erlang, whereis, [actor_receptionist_server]),
            Reds = fun() -> {reductions, R} = call(A, erlang, process_info, [Server, reductions]), R end,
            %% Local registrations on A.
            R0 = Reds(),
            ok = call(A, erlang, apply,
                      [fun() ->
                               Ref = spawn(timer, sleep, [infinity]),
                               [ok = actor_receptionist:register(key({many_local, I}), Ref)
                                || I <- lists:seq(1, NRegs)],
                               %% (Applied by the server and its C node;
                               %% the wait is the case's deadline.)
                               gen_server:call(actor_receptionist_server, sync, 120000)
                       end, []], 150000),
            R1 = Reds(),
            %% B's, through its deltas.
            RB = ref(B),
            ok = call(B, erlang, apply,
                      [fun() ->
                               [ok = actor_receptionist:register(key({many_remote, I}), RB)
                                || I <- lists:seq(1, NRegs)],
                               ok
                       end, []]),
            wait_until(fun() -> lookup(A, key({many_remote, NRegs})) =:= [RB] end, 120000),
            R2 = Reds(),
            io:format(user, "~nreductions per registration with ~b origins: local ~b, remote ~b~n",
                      [NOrigins, (R1 - R0) div NRegs, (R2 - R1) div NRegs]),
            ?assert((R1 - R0) div NRegs < 1000),
            ?assert((R2 - R1) div NRegs < 1000),
            converge(Ms, key({many_remote, 1}), [RB]),
            ?assert(erlang:monotonic_time(millisecond) - T0 < 120000)
        after
            catch peer:stop(F),
            wait_gone([FNode])
        end
    end).

%% Opt-in: a watched registration goes from every member when its process
%% dies, a process on this member or another one; an unwatched one stays
%% (the seed's default), on every member.
a_watched_registration_goes_from_every_member() ->
    with_members(3, fun([A, B, _C] = Ms) ->
        K = key(watched),
        Subs = [{M, subscriber(M, K)} || M <- Ms],
        Watched = ref(A), Unwatched = ref(A), OnB = ref(B),
        ok = call(A, actor_receptionist, register, [K, Watched, undefined, #{watch => true}]),
        ok = call(A, actor_receptionist, register, [K, Unwatched]),
        %% A process of another member, watched from A.
        ok = call(A, actor_receptionist, register, [K, OnB, undefined, #{watch => true}]),
        converge(Ms, K, [Watched, Unwatched, OnB]),
        %% The unwatched one dies first: by the time the watched one's
        %% death has gone round, A's receptionist has long seen nothing.
        kill(A, Unwatched),
        kill(A, Watched),
        converge(Ms, K, [Unwatched, OnB]),
        kill(B, OnB),
        converge(Ms, K, [Unwatched]),
        [wait_listing(M, S, K, [Unwatched]) || {M, S} <- Subs],
        [?assertEqual(no_repeats, repeats(listings(M, S, K))) || {M, S} <- Subs],
        ok = call(A, actor_receptionist, deregister, [K, Unwatched]),
        converge(Ms, K, [])
    end).

%% {via, actor_receptionist, Name}: a gen_server started under a name on
%% one member is called by that name from another; the name is taken on
%% every member, and free on every member once it stops; with two holders
%% every member picks the same one.
a_gen_server_named_on_one_member_is_called_from_another() ->
    with_members(3, fun([A, B, C] = Ms) ->
        Name = {cluster_named, ?FUNCTION_NAME},
        Via = {via, actor_receptionist, Name},
        K = actor_receptionist:name_key(Name),
        Start = fun(M) -> call(M, gen_server, start_link, [Via, ap_named_server, ok, []]) end,
        {ok, P} = Start(A),
        converge(Ms, K, [P]),
        ?assertEqual({P, node_of(A)}, call(B, gen_server, call, [Via, whoami])),
        [?assertEqual(P, call(M, actor_receptionist, whereis_name, [Name])) || M <- Ms],
        ?assertEqual({error, {already_started, P}}, Start(C)),
        ?assertEqual({error, {already_started, P}}, Start(A)),
        ?assertEqual(no, call(C, actor_receptionist, register_name, [Name, ref(C)])),
        ok = call(A, gen_server, stop, [P]),
        converge(Ms, K, []),
        [?assertEqual(undefined, call(M, actor_receptionist, whereis_name, [Name])) || M <- Ms],
        ?assertExit({noproc, _}, call(B, gen_server, call, [Via, whoami])),
        {ok, P2} = Start(C),
        converge(Ms, K, [P2]),
        ?assertEqual({P2, node_of(C)}, call(B, gen_server, call, [Via, whoami])),
        %% A second holder (as two register_name calls on two members within
        %% the gossip lag would make): the same pick everywhere.
        Q = ref(A),
        ok = call(A, actor_receptionist, register, [K, Q]),
        converge(Ms, K, [P2, Q]),
        Picks = [call(M, actor_receptionist, whereis_name, [Name]) || M <- Ms],
        ?assertEqual([lists:min([P2, Q])], lists:usort(Picks)),
        ok = call(A, actor_receptionist, deregister, [K, Q]),
        ok = call(C, gen_server, stop, [P2]),
        converge(Ms, K, [])
    end).

%% (On a peer) The messages of forged_gossip_changes_nothing/0, to the
%% servers of Targets; once each has handled them, how many of them come
%% on made-up aliases (each is counted as rejected).
forge_member(Targets, MemberPid, Inc, Ver, Id, Ref) ->
    Member = node(MemberPid),
    Old = [{ap_rcpt_state, MemberPid, Inc, Ver + 1000, []},
           {ap_rcpt_delta, MemberPid, Inc, Ver, Ver + 1, [{dereg, Id, Ref}]},
           {ap_rcpt_hello, MemberPid, Inc},
           {ap_rcpt_digest, MemberPid, Inc, Ver + 1000, []}],
    Made = fun(Target) ->
                   Aliases = [make_ref(), alias(), made_up_ref(Target), made_up_ref(Member)],
                   [{ap_rcpt2, Alias, Body}
                    || Alias <- Aliases,
                       Body <- [{state, Inc, Ver + 1000, []},
                                {delta, Inc, Ver, Ver + 1, [{dereg, Id, Ref}]},
                                {digest, Inc, Ver + 1000, []}, {welcome, alias()}, ask]]
           end,
    Hellos = [{ap_rcpt2_hello, alias(), member}, {ap_rcpt2_hello, made_up_ref(Member), member},
              {ap_rcpt2_hello, made_up_ref(Member), follower}],
    lists:foreach(fun(Target) ->
                          Dest = {actor_receptionist_server, Target},
                          [Dest ! M || M <- Old ++ Made(Target) ++ Hellos],
                          #{} = gen_server:call(Dest, status)
                  end, Targets),
    length(Old) + length(Made(hd(Targets))).

%% (On a peer) N states of made-up origins (and digests listing them) to
%% Target's server, in the older protocol (`old': relayed by MemberPid,
%% names as atoms) or this one (`new': on made-up aliases, names as
%% binaries); once it has handled them, how many messages.
forge_origins(Target, MemberPid, Format, N) ->
    Dest = {actor_receptionist_server, Target},
    Names = [iolist_to_binary(io_lib:format("forged_~s_~b@nowhere", [Format, I]))
             || I <- lists:seq(1, N)],
    Regs = fun(Name) -> [{<<"forged.", Name/binary>>, self()}] end,
    Msgs = case Format of
               old ->
                   [{ap_rcpt_origin_state, MemberPid, binary_to_atom(Name), 1, 1, Regs(Name)}
                    || Name <- Names]
                       ++ [{ap_rcpt_digest, MemberPid, 1, 1, [{binary_to_atom(Name), 1, 1}
                                                                 || Name <- Names]}];
               new ->
                   Alias = made_up_ref(Target),
                   Digest = [{Name, 1, 1} || Name <- Names],
                   [{ap_rcpt2, A, {origin_state, Name, 1, 1, Regs(Name)}}
                    || A <- [Alias, make_ref()], Name <- Names]
                       ++ [{ap_rcpt2, A, {digest, 1, 1, Digest}} || A <- [Alias, make_ref()]]
           end,
    [Dest ! M || M <- Msgs],
    #{} = gen_server:call(Dest, status),
    length(Msgs).

%% A reference of Node that nobody made (the external term format lets
%% anyone write one).
made_up_ref(Node) ->
    Name = atom_to_binary(Node),
    binary_to_term(<<131, 90, 3:16, 119, (byte_size(Name)):8, Name/binary, 7:32,
                     (rand:uniform(16#3ffff)):32, (rand:uniform(1 bsl 30)):32,
                     (rand:uniform(1 bsl 30)):32>>).

%% (On the node of test A) What a forged origin would cost: atoms, ETS
%% tables, the C node's origin slots, the origins held, gossip rejected.
footprint() ->
    #{origins := Os, gossip := G} = actor_receptionist:status(),
    #{origins := CnodeOrigins} = actor_receptionist:stats(),
    #{atoms => erlang:system_info(atom_count), tables => length(ets:all()),
      cnode_origins => CnodeOrigins, origins => lists:sort(maps:keys(Os)),
      rejected => maps:get(rejected, G, 0)}.

%% (On a plain peer) A receptionist server as far as member Member can
%% tell: it opens a channel with Member, and lists Names as the origins it
%% reaches directly, each with one registration (key `relay.Name', a
%% process of this node registered as fake_relay_ref). It sends its digest
%% every 200 ms until Member has asked for every name (Member sends its
%% requests without waiting on a busy connection: some may be lost, as a
%% real relay's next round would mend), then no more, and answers none of
%% Member's: Member keeps what it holds through it and spends nothing on
%% its digests while measured.
fake_relay(Member, Names) ->
    true = register(actor_receptionist_server, self()),
    Ref = spawn(timer, sleep, [infinity]),
    true = register(fake_relay_ref, Ref),
    relay_loop(#{server => {actor_receptionist_server, Member}, mine => alias(), out => undefined,
                 names => Names, ref => Ref, asked => #{}, due => now_ms()}).

relay_loop(#{server := Server, mine := Mine, out := Out, names := Names, ref := Ref,
             asked := Asked, due := Due} = S) ->
    Send = fun(Body) -> erlang:send(Out, {ap_rcpt2, Out, Body}) end,
    Digest = fun() -> Send({digest, 1, 1, [{Name, 1, 1} || Name <- Names]}) end,
    %% Every 200 ms (a deadline: Member's own messages come as often).
    Wait = case Out =:= undefined orelse map_size(Asked) < length(Names) of
               true -> max(0, Due - now_ms());
               false -> infinity
           end,
    receive
        {ap_rcpt2_hello, X, member} ->
            %% Member's probe: welcome it, and say hello back until it
            %% welcomes us.
            Server ! {ap_rcpt2, X, {welcome, Mine}},
            Out =:= undefined andalso (Server ! {ap_rcpt2_hello, Mine, member}),
            relay_loop(S);
        {ap_rcpt2, Mine, {welcome, W}} when Out =:= undefined ->
            erlang:send(W, {ap_rcpt2, W, {state, 1, 1, []}}),
            relay_loop(S#{out := W});
        {ap_rcpt2, Mine, ask} when Out =/= undefined ->
            Send({state, 1, 1, []}),
            relay_loop(S);
        {ap_rcpt2, Mine, {want_origin, Name}} when Out =/= undefined ->
            Send({origin_state, Name, 1, 1, [{<<"relay.", Name/binary>>, Ref}]}),
            relay_loop(S#{asked := Asked#{Name => true}});
        _ ->
            relay_loop(S)
    after Wait ->
        case Out of
            %% Not welcomed yet (Member may have probed this node before
            %% this process had its name): say hello.
            undefined -> Server ! {ap_rcpt2_hello, Mine, member};
            _ -> Digest()
        end,
        relay_loop(S#{due := now_ms() + 200})
    end.

now_ms() ->
    erlang:monotonic_time(millisecond).

%% ===================================================================
%% Helpers
%% ===================================================================

key(Name) ->
    actor_receptionist:service_key(iolist_to_binary(io_lib:format("cluster.~0p", [Name]))).

call(Peer, M, F, A) ->
    call(Peer, M, F, A, 30000).

call(Peer, M, F, A, Timeout) ->
    peer:call(Peer, M, F, A, Timeout).

node_of(Peer) ->
    call(Peer, erlang, node, []).

%% A long-lived process on the member: a ref to register.
ref(Peer) ->
    call(Peer, erlang, spawn, [timer, sleep, [infinity]]).

%% Kills process Pid of the member, and waits until it is dead.
kill(Peer, Pid) ->
    true = call(Peer, erlang, exit, [Pid, kill]),
    wait_until(fun() -> not call(Peer, erlang, is_process_alive, [Pid]) end, ?WAIT_MS).

subscriber(Peer, K) ->
    S = call(Peer, ap_test_util, spawn_collector, []),
    ok = call(Peer, actor_receptionist, subscribe, [K, S]),
    S.

%% The listings for K that collector S got, each as a sorted list.
listings(Peer, S, {service_key, _} = K) ->
    [lists:sort(Refs) || {listing, K2, Refs} <- call(Peer, ap_test_util, collected, [S]), K2 =:= K].

repeats([A, A | _]) -> {repeated, A};
repeats([_ | T]) -> repeats(T);
repeats([]) -> no_repeats.

wait_listing(Peer, S, K, Want) ->
    W = lists:sort(Want),
    wait_until(fun() ->
                       case listings(Peer, S, K) of
                           [] -> false;
                           Ls -> lists:last(Ls) =:= W
                       end
               end, ?WAIT_MS).

lookup(Peer, K) ->
    call(Peer, actor_receptionist, lookup, [K]).

find(Peer, K) ->
    call(Peer, erlang, apply,
         [fun() ->
                  ok = actor_receptionist:find(K, self()),
                  receive {listing, K, Refs} -> Refs after 10000 -> timeout end
          end, []]).

converged(Ms, K, Want) ->
    W = lists:sort(Want),
    try wait_until(fun() -> lists:all(fun(M) -> lists:sort(lookup(M, K)) =:= W end, Ms) end, ?WAIT_MS) of
        _ -> true
    catch
        _:_ ->
            io:format(user, "not converged on ~p: want ~p, have ~p~n",
                      [K, W, [lookup(M, K) || M <- Ms]]),
            false
    end.

converge(Ms, K, Want) ->
    ?assert(converged(Ms, K, Want)).

%% With A and B cut apart (both still reach C): a registration on each
%% side and a deregistration on B reach everyone through C. Returns the
%% two new refs.
change_both_sides_while_cut([A, B, _C] = Ms, K, [RA, RB, RC]) ->
    RA2 = ref(A), RB2 = ref(B),
    ok = call(A, actor_receptionist, register, [K, RA2]),
    ok = call(B, actor_receptionist, register, [K, RB2]),
    ok = call(B, actor_receptionist, deregister, [K, RB]),
    converge(Ms, K, [RA, RA2, RB2, RC]),
    {RA2, RB2}.

%% N members, meshed and synced; stopped (and out of epmd) afterwards.
with_members(N, Fun) ->
    Started = [start_member() || _ <- lists:seq(1, N)],
    Peers = [P || {P, _} <- Started],
    try
        mesh(Peers),
        Fun(Peers)
    after
        [stop_member(P) || P <- Peers]
    end.

start_member() ->
    start_member(peer:random_name(rcpt_cluster)).

start_member(Name) ->
    start_member(Name, []).

start_member(Name, Extra) ->
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE, ap_test_util]]),
    %% Not linked: a case kills members. Only explicit connections (no
    %% global mesh), and no partition prevention, so cuts stay cuts.
    {ok, Peer, _Node} =
        peer:start(#{name => Name,
                     connection => standard_io,
                     args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                              "-connect_all", "false",
                              "-kernel", "prevent_overlapping_partitions", "false"]
                             ++ Extra ++ ["-pa" | Paths]}),
    ok = call(Peer, application, load, [actor_pool]),
    ok = call(Peer, application, set_env, [actor_pool, pool_node, false]),
    ok = call(Peer, application, set_env, [actor_pool, gossip_interval_ms, ?GOSSIP_MS]),
    ok = call(Peer, application, set_env, [actor_pool, receptionist_shm_mb, 16]),
    {ok, _} = call(Peer, application, ensure_all_started, [actor_pool]),
    %% Its names, to see them leave epmd (and its segment /dev/shm) even if
    %% the case kills it.
    Rcpt = call(Peer, actor_receptionist, receptionist_node, []),
    put({member, Peer}, [call(Peer, erlang, node, []), Rcpt]),
    put({segment, Peer}, ap_test_util:segment(Rcpt)),
    own_segment(get({segment, Peer})),
    {Peer, Name}.

%% The leak check at the end sees this member's segment (ap_test_util's
%% names for this test run cover it).
own_segment(Path) ->
    ?assert(filelib:is_file(Path)),
    ?assert(lists:member(filename:basename(Path), ap_test_util:own_segments())).

stop_member(Peer) ->
    catch call(Peer, application, stop, [actor_pool]),
    catch peer:stop(Peer),
    wait_gone(get({member, Peer})),
    Segment = get({segment, Peer}),
    wait_until(fun() -> not filelib:is_file(Segment) end, ?WAIT_MS).

wait_gone(Nodes) ->
    Alives = [hd(string:split(atom_to_list(N), "@")) || N <- Nodes, is_atom(N), N =/= undefined],
    wait_until(fun() -> [A || A <- Alives, lists:member(A, epmd_names())] =:= [] end, ?WAIT_MS).

%% Connect every pair and wait until every member sees the others synced.
mesh(Peers) ->
    Nodes = [node_of(P) || P <- Peers],
    [true = call(P, net_kernel, connect_node, [N]) || P <- Peers, N <- Nodes, N =/= node_of(P)],
    [wait_until(fun() ->
                        case call(P, actor_receptionist, status, []) of
                            #{complete := true, members := Mem} -> Mem =:= lists:sort(Nodes -- [node_of(P)]);
                            _ -> false
                        end
                end, ?WAIT_MS) || P <- Peers],
    ok.
