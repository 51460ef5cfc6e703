%% The snapshot NIF alone (actor_nif), against segments written by this
%% module: a POSIX shm object "/name" is the file /dev/shm/name on Linux, so
%% the test encodes the layout of c_src/shm/ap_shm.h itself (header, two
%% halves, index, arena) and writes it there; the NIF shm_opens it.
%%
%% A mapped segment is changed only in place (pwrite), never rewritten with
%% file:write_file: truncating a mapped file makes reads past its new end
%% raise SIGBUS. Every case uses fresh names; every file is removed at the
%% end (unlinking a mapped segment is fine, the mapping keeps the object).
-module(actor_nif_tests).

-include_lib("eunit/include/eunit.hrl").

%% The cases, called through ?MODULE by run/2.
-export([nif_is_loaded/1,
         hash_matches_the_c_vectors/1,
         not_attached_is_unmapped/1,
         attach_missing_is_enoent/1,
         attach_too_small/1,
         attach_not_private_is_eacces/1,
         bad_arguments_are_badarg/1,
         valid_segment_answers_the_pids/1,
         wrong_node_keeps_the_current_mapping/1,
         removed_key_is_empty/1,
         update_in_place_and_gen_flips/1,
         large_values_and_too_big/1,
         hostile_headers_are_bad_segment/1,
         hostile_entries_are_bad_segment_or_empty/1,
         hostile_values_are_bad_segment/1,
         random_corruption_never_crashes/1,
         stale_and_closed_state/1,
         key_cache_follows_counted_updates/1,
         key_cache_never_survives_a_reattach/1,
         key_cache_honours_the_state/1,
         reattach_while_others_look_up/1,
         many_reattaches_retire_old_mappings/1,
         remote_pids_are_answered/1,
         reload_upgrade_and_unload/1,
         detach_unmaps/1,
         info_describes_the_mapping/1,
         remove_segment_takes_only_a_dead_writers_snapshot/1]).

-define(MAGIC, 16#31535450435241).
-define(VERSION, 5).
-define(HDR_SIZE, 4096).
-define(CAP, 1024).
-define(ARENA, 262144).
-define(LIVE, 1).
-define(STALE, 2).
-define(CLOSED, 3).
-define(NODE, <<"rcpt_test@localhost">>).
%% Header field offsets (struct ap_shm_hdr).
-define(GEN_POS, 32).
-define(STATE_POS, 64).
-define(CHANGES_POS, 72).
-define(SEED_POS, 80).
-define(NODE_POS, 88).
%% The hash_seed of every segment built here (a writer draws a random one).
-define(SEED, 16#5EED0123456789AB).
%% Half header (struct ap_shm_half) and entry header sizes.
-define(HALF_HDR, 64).
-define(ENTRY_HDR, 16).
-define(MASK64, 16#FFFFFFFFFFFFFFFF).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_nif_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> run(Name, Ctx) end}}
              || Name <- [nif_is_loaded,
                          hash_matches_the_c_vectors,
                          not_attached_is_unmapped,
                          attach_missing_is_enoent,
                          attach_too_small,
                          attach_not_private_is_eacces,
                          bad_arguments_are_badarg,
                          valid_segment_answers_the_pids,
                          wrong_node_keeps_the_current_mapping,
                          removed_key_is_empty,
                          update_in_place_and_gen_flips,
                          large_values_and_too_big,
                          hostile_headers_are_bad_segment,
                          hostile_entries_are_bad_segment_or_empty,
                          hostile_values_are_bad_segment,
                          random_corruption_never_crashes,
                          stale_and_closed_state,
                          key_cache_follows_counted_updates,
                          key_cache_never_survives_a_reattach,
                          key_cache_honours_the_state,
                          reattach_while_others_look_up,
                          many_reattaches_retire_old_mappings,
                          remote_pids_are_answered,
                          reload_upgrade_and_unload,
                          detach_unmaps,
                          info_describes_the_mapping,
                          remove_segment_takes_only_a_dead_writers_snapshot]]
     end}.

setup() ->
    {module, actor_nif} = code:ensure_loaded(actor_nif),
    Pids = [spawn(fun() -> receive stop -> ok end end) || _ <- lists:seq(1, 10)],
    Prefix = "ap_nif_t_" ++ os:getpid() ++ "_",
    #{pids => Pids, prefix => Prefix}.

cleanup(#{pids := Pids, prefix := Prefix}) ->
    _ = catch actor_nif:detach(),
    [P ! stop || P <- Pids],
    {ok, Files} = file:list_dir("/dev/shm"),
    [ok = file:delete("/dev/shm/" ++ F) || F <- Files, lists:prefix(Prefix, F)],
    ok.

%% Every case starts with nothing attached.
run(Name, Ctx) ->
    ok = actor_nif:detach(),
    ?MODULE:Name(Ctx).

%% ===================================================================
%% Cases
%% ===================================================================

nif_is_loaded(_) ->
    ?assert(actor_nif:loaded()).

%% hash/2 is ap_shm_hash: SipHash-1-3 keyed (Seed, Seed bxor K1). Vectors
%% from c_src/test/test_shm.c (test_hash_known_vectors), plus the SipHash
%% paper's SipHash-2-4 vector through the same code with 2 and 4 rounds.
hash_matches_the_c_vectors(_) ->
    Seq = fun(N) -> list_to_binary(lists:seq(0, N - 1)) end,
    ?assertEqual(16#a129ca6149be45e5,
                 siphash(2, 4, 16#0706050403020100, 16#0f0e0d0c0b0a0908, Seq(15))),
    Vectors = [{0, <<>>, 16#61d1b8495b88d5e1},
               {0, <<"a">>, 16#6cd2f1583967b431},
               {0, <<"abcdefg">>, 16#b23b9bf39130a21d},
               {0, <<"abcdefgh">>, 16#3d09067e6f99cbe8},
               {0, Seq(15), 16#8e92628c2674d2fe},
               {0, <<"key-000042">>, 16#b105583196c4a5d9},
               {0, Seq(64), 16#7e56f13b96de6ecb},
               {16#0706050403020100, <<>>, 16#b8caed77a440bbba},
               {16#0706050403020100, <<"abcdefgh">>, 16#3c599e837f03032b},
               {16#0706050403020100, Seq(15), 16#1f8336568070576d},
               {16#0123456789abcdef, <<"a">>, 16#9d3d0c2d828ea9a6},
               {16#0123456789abcdef, <<"abcdefg">>, 16#cfd190c99671d713},
               {16#0123456789abcdef, <<"key-000042">>, 16#416b62d8a7317b42},
               {16#0123456789abcdef, Seq(64), 16#fed88c2f19252a0f},
               {?MASK64, <<>>, 16#3e35ada38e8df913},
               {?MASK64, Seq(15), 16#829b447612f9d75c},
               {?MASK64, <<"key-000042">>, 16#de3f65e916ea5c83},
               {?MASK64, Seq(64), 16#99087a07ff64a5ae}],
    [?assertEqual({S, M, W}, {S, M, hash(S, M)}) || {S, M, W} <- Vectors],
    ok.

not_attached_is_unmapped(_) ->
    ?assertEqual({error, unmapped}, actor_nif:lookup(<<"k">>)),
    ?assertMatch(#{mapped := false}, actor_nif:info()).

attach_missing_is_enoent(Ctx) ->
    ?assertEqual({error, enoent}, actor_nif:attach(name(Ctx), ?NODE)),
    ?assertEqual({error, unmapped}, actor_nif:lookup(<<"k">>)).

attach_too_small(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, <<?MAGIC:64/native, 0:(100 * 8)>>),
    ?assertEqual({error, too_small}, actor_nif:attach(Name, ?NODE)),
    Empty = name(Ctx),
    write_seg(Empty, <<>>),
    ?assertEqual({error, too_small}, actor_nif:attach(Empty, ?NODE)),
    rm(Name),
    rm(Empty).

%% A segment another user could write (so truncate) is refused.
attach_not_private_is_eacces(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{<<"k">>, pids_val(Ctx)}]})),
    ok = file:change_mode(shm_path(Name), 8#622),
    ?assertEqual({error, eacces}, actor_nif:attach(Name, ?NODE)),
    ok = file:change_mode(shm_path(Name), 8#600),
    ?assertEqual(ok, actor_nif:attach(Name, ?NODE)),
    rm(Name).

bad_arguments_are_badarg(Ctx) ->
    ?assertError(badarg, actor_nif:lookup("k")),
    ?assertError(badarg, actor_nif:lookup(k)),
    ?assertError(badarg, actor_nif:attach("/x", ?NODE)),
    ?assertError(badarg, actor_nif:attach(<<>>, ?NODE)),
    ?assertError(badarg, actor_nif:attach(<<"/a", 0, "b">>, ?NODE)),
    ?assertError(badarg, actor_nif:attach(<<"/x">>, binary:copy(<<"n">>, 256))),
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{<<"k">>, pids_val(Ctx)}]})),
    ok = actor_nif:attach(Name, ?NODE),
    Max = binary:copy(<<"k">>, 1024),
    ?assertEqual([], actor_nif:lookup(Max)),
    ?assertError(badarg, actor_nif:lookup(<<Max/binary, "k">>)),
    rm(Name).

valid_segment_answers_the_pids(#{pids := Pids} = Ctx) ->
    Name = name(Ctx),
    Keys = [{<<"k", (integer_to_binary(I))/binary>>, lists:sublist(Pids, I)}
            || I <- lists:seq(1, 10)],
    Entries = [{<<"self">>, term_to_binary([self()])},
               {<<"empty">>, term_to_binary([])},
               {<<>>, term_to_binary([self(), self()])}
              | [{K, term_to_binary(V)} || {K, V} <- Keys]],
    write_seg(Name, segment(#{half0 => Entries})),
    ?assertEqual(ok, actor_nif:attach(Name, ?NODE)),
    %% Twice: the second answer comes from the thread's cache.
    [?assertEqual(V, actor_nif:lookup(K)) || _ <- [1, 2], {K, V} <- Keys],
    ?assertEqual([self()], actor_nif:lookup(<<"self">>)),
    ?assertEqual([], actor_nif:lookup(<<"empty">>)),
    ?assertEqual([self(), self()], actor_nif:lookup(<<>>)),
    ?assertEqual([], actor_nif:lookup(<<"nope">>)),
    ?assertEqual([], actor_nif:lookup(<<"k11">>)),
    %% Sub-binaries and large (refc) keys too.
    <<_, Sub:2/binary, _/binary>> = <<"xk3yz">>,
    ?assertEqual(lists:sublist(Pids, 3), actor_nif:lookup(Sub)),
    ?assertEqual([], actor_nif:lookup(binary:copy(<<"z">>, 1000))),
    rm(Name).

wrong_node_keeps_the_current_mapping(Ctx) ->
    Good = name(Ctx),
    write_seg(Good, segment(#{half0 => [{<<"k">>, term_to_binary([self()])}]})),
    ok = actor_nif:attach(Good, ?NODE),
    Other = name(Ctx),
    write_seg(Other, segment(#{node => <<"other@localhost">>,
                               half0 => [{<<"k">>, term_to_binary([])}]})),
    ?assertEqual({error, wrong_node}, actor_nif:attach(Other, ?NODE)),
    ?assertEqual({error, wrong_node}, actor_nif:attach(Good, <<"rcpt_test@localhos">>)),
    ?assertEqual({error, wrong_node}, actor_nif:attach(Good, <<?NODE/binary, "x">>)),
    ?assertEqual({error, enoent}, actor_nif:attach(name(Ctx), ?NODE)),
    ?assertEqual([self()], actor_nif:lookup(<<"k">>)),
    ?assertMatch(#{path := Good}, actor_nif:info()),
    rm(Good),
    rm(Other).

removed_key_is_empty(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{<<"a">>, pids_val(Ctx)},
                                        {<<"b">>, pids_val(Ctx)},
                                        {<<"a">>, <<>>}]})),
    ok = actor_nif:attach(Name, ?NODE),
    ?assertEqual([], actor_nif:lookup(<<"a">>)),
    ?assertEqual(pids(Ctx), actor_nif:lookup(<<"b">>)),
    rm(Name).

%% What the writer does, done by hand: append an entry and repoint its slot
%% (same gen); rebuild the other half and bump gen; later rebuild half 0
%% again with other values at the same offsets; and, like the writer, count
%% each change once it is published. The per-thread caches are keyed by
%% (mapping, gen, offset) and by (key, changes) and must follow every step.
update_in_place_and_gen_flips(#{pids := [P1, P2, P3 | _]} = Ctx) ->
    Name = name(Ctx),
    V1 = [{<<"a">>, term_to_binary([P1])}, {<<"b">>, term_to_binary([P2])}],
    write_seg(Name, segment(#{half0 => V1})),
    ok = actor_nif:attach(Name, ?NODE),
    ?assertEqual([P1], actor_nif:lookup(<<"a">>)),
    ?assertEqual([P1], actor_nif:lookup(<<"a">>)),
    %% Same gen: a new entry for "a", its slot repointed.
    V2 = V1 ++ [{<<"a">>, term_to_binary([P3, P1])}],
    pwrite_half(Name, 0, V2),
    count(Name),
    ?assertEqual([P3, P1], actor_nif:lookup(<<"a">>)),
    ?assertEqual([P2], actor_nif:lookup(<<"b">>)),
    %% Compaction into half 1, then gen 1.
    V3 = [{<<"b">>, term_to_binary([P2, P2])}, {<<"a">>, term_to_binary([P1])}],
    pwrite_half(Name, 1, V3),
    ?assertEqual([P3, P1], actor_nif:lookup(<<"a">>)),
    pwrite_gen(Name, 1),
    count(Name),
    ?assertEqual([P1], actor_nif:lookup(<<"a">>)),
    ?assertEqual([P2, P2], actor_nif:lookup(<<"b">>)),
    %% Back to half 0 (gen 2) with other values at the very same offsets as
    %% at gen 0: the cached gen-0 terms must not be answered.
    V4 = [{<<"a">>, term_to_binary([P2])}, {<<"b">>, term_to_binary([P3])}],
    pwrite_half(Name, 0, V4),
    pwrite_gen(Name, 2),
    count(Name),
    ?assertEqual([P2], actor_nif:lookup(<<"a">>)),
    ?assertEqual([P3], actor_nif:lookup(<<"b">>)),
    ?assertMatch(#{gen := 2}, actor_nif:info()),
    rm(Name).

%% Over 64 KiB the copy and decode run on a dirty scheduler. A value over
%% 16 MiB is one no writer makes: the reader API calls it a bad segment
%% (the NIF's own too_big check stays behind it, unreachable); one of 16 MiB
%% exactly is copied (dirty) and refused by the decoder.
large_values_and_too_big(Ctx) ->
    Name = name(Ctx),
    Mid = [self() || _ <- lists:seq(1, 700)],      % ~20 KB: not cached
    Big = [self() || _ <- lists:seq(1, 5000)],     % ~140 KB: dirty
    MidBin = term_to_binary(Mid),
    BigBin = term_to_binary(Big),
    ?assert(byte_size(MidBin) > 16384 andalso byte_size(MidBin) < 65536),
    ?assert(byte_size(BigBin) > 65536),
    write_seg(Name, segment(#{arena => 1 bsl 20,
                              half0 => [{<<"mid">>, MidBin}, {<<"big">>, BigBin}]})),
    ok = actor_nif:attach(Name, ?NODE),
    [?assertEqual(Mid, actor_nif:lookup(<<"mid">>)) || _ <- [1, 2]],
    [?assertEqual(Big, actor_nif:lookup(<<"big">>)) || _ <- [1, 2]],
    %% Not a list of pids, on the dirty path too.
    Junk = name(Ctx),
    JunkBin = term_to_binary([self() || _ <- lists:seq(1, 4000)] ++ [x]),
    write_seg(Junk, segment(#{arena => 1 bsl 20, half0 => [{<<"j">>, JunkBin}]})),
    ok = actor_nif:attach(Junk, ?NODE),
    ?assertEqual({error, bad_segment}, actor_nif:lookup(<<"j">>)),
    Huge = name(Ctx),
    Max = 16 bsl 20,
    write_seg(Huge, segment(#{arena => Max + 8192,
                              half0 => [{<<"max">>, <<131, 106, 0:((Max - 2) * 8)>>},
                                        {<<"s">>, term_to_binary([self()])}]})),
    ok = actor_nif:attach(Huge, ?NODE),
    ?assertEqual({error, bad_segment}, actor_nif:lookup(<<"max">>)),
    ?assertEqual([self()], actor_nif:lookup(<<"s">>)),
    %% Declare one byte more than 16 MiB (the bytes are there).
    Over = name(Ctx),
    write_seg(Over, patch(segment(#{arena => Max + 8192,
                                    half0 => [{<<"over">>, <<131, 106, 0:((Max - 2) * 8)>>}]}),
                          entry_pos(0, 8, Max + 8192) + 12, <<(Max + 1):32/native>>)),
    ok = actor_nif:attach(Over, ?NODE),
    ?assertEqual({error, bad_segment}, actor_nif:lookup(<<"over">>)),
    [rm(N) || N <- [Name, Junk, Huge, Over]].

hostile_headers_are_bad_segment(Ctx) ->
    Good = segment(#{half0 => [{<<"k">>, pids_val(Ctx)}]}),
    SegSize = byte_size(Good),
    HalfSize = (SegSize - ?HDR_SIZE) div 2,
    Half0 = ?HDR_SIZE,
    Bad = [{magic, patch(Good, 0, <<0:64>>)},
           {version, patch(Good, 8, <<(?VERSION + 1):32/native>>)},
           {version_old, patch(Good, 8, <<(?VERSION - 1):32/native>>)},
           {hdr_size, patch(Good, 12, <<8192:32/native>>)},
           {seg_size_over_file, patch(Good, 16, <<(SegSize * 2):64/native>>)},
           {seg_size_huge, patch(Good, 16, <<?MASK64:64/native>>)},
           {half_size_huge, patch(Good, 24, <<(1 bsl 62):64/native>>)},
           {half_size_over, patch(Good, 24, <<(HalfSize + 8):64/native>>)},
           {node_unterminated, patch(Good, ?NODE_POS, binary:copy(<<"n">>, 256))},
           {cap_not_pow2, patch(Good, Half0, <<1025:64/native>>)},
           {cap_huge, patch(Good, Half0, <<(1 bsl 40):64/native>>)},
           {cap_zero, patch(Good, Half0, <<0:64/native>>)},
           {arena_off_out, patch(Good, Half0 + 8, <<(HalfSize + 8):64/native>>)},
           {arena_off_in_index, patch(Good, Half0 + 8, <<64:64/native>>)},
           {arena_size_out, patch(Good, Half0 + 16, <<HalfSize:64/native>>)},
           {arena_size_huge, patch(Good, Half0 + 16, <<?MASK64:64/native>>)},
           {truncated_file, binary:part(Good, 0, SegSize - 4096)},
           {zeros, <<0:(SegSize * 8)>>}],
    lists:foreach(
      fun({What, Bin}) ->
              Name = name(Ctx),
              write_seg(Name, Bin),
              ?assertEqual({What, {error, bad_segment}},
                           {What, actor_nif:attach(Name, ?NODE)}),
              rm(Name)
      end, Bad),
    ?assertEqual({error, unmapped}, actor_nif:lookup(<<"k">>)).

%% Slots and entries that point outside the arena, or lie about lengths: the
%% segment attaches (its header is fine), the lookups refuse.
hostile_entries_are_bad_segment_or_empty(Ctx) ->
    Key = <<"k">>,
    Good = segment(#{half0 => [{Key, pids_val(Ctx)}]}),
    Slot = slot_pos(0, Key),
    Tag = hash(Key) bsr 32,
    Entry = entry_pos(0, 8),
    Bad = [{slot_off_max, patch(Good, Slot, <<((Tag bsl 32) bor 16#FFFFFFFF):64/native>>)},
           {slot_off_past_arena, patch(Good, Slot, <<((Tag bsl 32) bor (?ARENA div 8)):64/native>>)},
           {slot_off_last_bytes, patch(Good, Slot, <<((Tag bsl 32) bor (?ARENA div 8 - 1)):64/native>>)},
           {slot_off_misaligned_tag, patch(Good, Slot, <<((Tag bsl 32) bor 3):64/native>>)},
           {val_len_huge, patch(Good, Entry + 12, <<16#FFFFFFFF:32/native>>)},
           {val_len_past_arena, patch(Good, Entry + 12, <<?ARENA:32/native>>)},
           {key_len_huge, patch(Good, Entry + 8, <<16#FFFFFFFF:32/native>>)},
           %% every probe runs the whole index and finds nothing
           {every_slot_full, patch(Good, slot_pos(0, 0),
                                   binary:copy(<<((16#DEADBEEF bsl 32) bor 1):64/native>>, ?CAP))},
           {hash_mismatch, patch(Good, Entry, <<0:64>>)},
           %% another seed: every key hashes elsewhere, so nothing is found
           {seed_changed, patch(Good, ?SEED_POS, <<(?SEED bxor 1):64/native>>)}],
    lists:foreach(
      fun({What, Bin}) ->
              Name = name(Ctx),
              write_seg(Name, Bin),
              ?assertEqual({What, ok}, {What, actor_nif:attach(Name, ?NODE)}),
              R = actor_nif:lookup(Key),
              ?assert({What, R} =:= {What, {error, bad_segment}} orelse {What, R} =:= {What, []}),
              ?assertMatch({_, R2} when R2 =:= [] orelse R2 =:= {error, bad_segment},
                           {What, actor_nif:lookup(<<"other">>)}),
              rm(Name)
      end, Bad).

hostile_values_are_bad_segment(Ctx) ->
    Pid = term_to_binary([self()]),
    Values = [{atom, term_to_binary(foo)},
              {ints, term_to_binary([1, 2, 3])},
              {pid_and_int, term_to_binary([self(), 1])},
              {improper, term_to_binary([self() | self()])},
              {nested, term_to_binary([[self()]])},
              {tuple, term_to_binary({self()})},
              {bare_pid, term_to_binary(self())},
              {trailing_byte, <<Pid/binary, 0>>},
              {truncated, binary:part(Pid, 0, byte_size(Pid) - 1)},
              {no_version, binary:part(Pid, 1, byte_size(Pid) - 1)},
              {compressed, term_to_binary([self() || _ <- lists:seq(1, 200)], [compressed])},
              {zip_bomb, <<131, 80, 16#FFFFFFFF:32, 120, 156, 0, 0, 0, 0>>},
              {garbage, <<131, 108, 0, 0, 0, 5, 1, 2, 3, 4, 5, 6, 7, 8>>},
              {list_len_lies, <<131, 108, 16#FFFFFFFF:32, 106>>},
              {one_byte, <<131>>},
              {zeros, <<0:800>>},
              {new_atom, <<131, 108, 1:32, 119, 20, "never_an_atom_x_9q7z", 106>>}],
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{atom_to_binary(K), V} || {K, V} <- Values]
                                       ++ [{<<"ok">>, Pid}]})),
    ok = actor_nif:attach(Name, ?NODE),
    [?assertEqual({K, {error, bad_segment}}, {K, actor_nif:lookup(atom_to_binary(K))})
     || _ <- [1, 2], {K, _} <- Values],
    ?assertEqual([self()], actor_nif:lookup(<<"ok">>)),
    %% SAFE decoding made no atom.
    ?assertError(badarg, binary_to_existing_atom(<<"never_an_atom_x_9q7z">>, utf8)),
    rm(Name).

%% Random bytes over a valid segment's header, index and arena: whatever
%% attach and lookup answer, they answer, and the VM lives on.
random_corruption_never_crashes(#{pids := Pids} = Ctx) ->
    Keys = [<<"key", (integer_to_binary(I))/binary>> || I <- lists:seq(1, 20)],
    Good = segment(#{half0 => [{K, term_to_binary(lists:sublist(Pids, 1 + I rem 10))}
                               || {I, K} <- lists:enumerate(Keys)]}),
    <<_:(?HDR_SIZE + 24)/binary, ArenaUsed:64/native, _/binary>> = Good,
    Regions = [{0, ?NODE_POS}, {?HDR_SIZE, ?HALF_HDR}, {?HDR_SIZE + ?HALF_HDR, ?CAP * 8},
               {entry_pos(0, 0), ArenaUsed}],
    rand:seed(exsss, {7, 11, 13}),
    Results = lists:map(
                fun(_) ->
                        Bin = lists:foldl(fun(_, B) -> corrupt(B, Regions) end, Good,
                                          lists:seq(1, rand:uniform(4))),
                        Name = name(Ctx),
                        write_seg(Name, Bin),
                        A = actor_nif:attach(Name, ?NODE),
                        Ls = [actor_nif:lookup(K) || K <- [<<"nope">> | Keys]],
                        [?assert(is_list(L) orelse element(1, L) =:= error) || L <- Ls],
                        [[?assert(is_pid(P)) || P <- L] || L <- Ls, is_list(L)],
                        rm(Name),
                        A
                end, lists:seq(1, 300)),
    %% Most corruptions land in the arena or the index and still attach.
    ?assert(length([ok || ok <- Results]) > 100).

stale_and_closed_state(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, segment(#{state => ?STALE, half0 => [{<<"k">>, pids_val(Ctx)}]})),
    ?assertEqual(ok, actor_nif:attach(Name, ?NODE)),
    ?assertEqual({error, stale}, actor_nif:lookup(<<"k">>)),
    ?assertMatch(#{state := stale}, actor_nif:info()),
    pwrite_state(Name, ?LIVE),
    ?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)),
    ?assertMatch(#{state := live}, actor_nif:info()),
    pwrite_state(Name, ?CLOSED),
    ?assertEqual({error, stale}, actor_nif:lookup(<<"k">>)),
    ?assertMatch(#{state := closed}, actor_nif:info()),
    pwrite_state(Name, 77),
    ?assertMatch(#{state := unknown}, actor_nif:info()),
    rm(Name).

%% Repeated lookups are answered from the key cache, labelled with the
%% segment's `changes': an update the writer counted is seen at once, at a
%% new offset (same gen) as after a gen switch, for found keys and for
%% missing ones. What an uncounted update gives is not specified (either
%% value), but counting it makes it visible. A segment whose counter is 0
%% (no label) is looked up every time.
key_cache_follows_counted_updates(#{pids := [P1, P2, P3 | _]} = Ctx) ->
    Name = name(Ctx),
    V1 = [{<<"a">>, term_to_binary([P1])}, {<<"b">>, term_to_binary([P2])}],
    write_seg(Name, segment(#{half0 => V1})),
    ok = actor_nif:attach(Name, ?NODE),
    [?assertEqual([P1], actor_nif:lookup(<<"a">>)) || _ <- [1, 2, 3]],
    [?assertEqual([], actor_nif:lookup(<<"new">>)) || _ <- [1, 2, 3]],
    %% Same gen, a new entry for "a" at a new offset, and a new key.
    V2 = V1 ++ [{<<"a">>, term_to_binary([P3, P1])}, {<<"new">>, term_to_binary([P2])}],
    pwrite_half(Name, 0, V2),
    [?assert(lists:member(actor_nif:lookup(<<"a">>), [[P1], [P3, P1]])) || _ <- [1, 2]],
    count(Name),
    ?assertEqual(2, changes(Name)),
    [?assertEqual([P3, P1], actor_nif:lookup(<<"a">>)) || _ <- [1, 2, 3]],
    [?assertEqual([P2], actor_nif:lookup(<<"new">>)) || _ <- [1, 2, 3]],
    [?assertEqual([P2], actor_nif:lookup(<<"b">>)) || _ <- [1, 2, 3]],
    %% A removal (an empty value appended), counted.
    pwrite_half(Name, 0, V2 ++ [{<<"new">>, <<>>}]),
    count(Name),
    [?assertEqual([], actor_nif:lookup(<<"new">>)) || _ <- [1, 2]],
    %% A compaction into half 1 and a gen switch, counted.
    pwrite_half(Name, 1, [{<<"a">>, term_to_binary([P2])}, {<<"b">>, term_to_binary([P1])}]),
    pwrite_gen(Name, 1),
    count(Name),
    [?assertEqual([P2], actor_nif:lookup(<<"a">>)) || _ <- [1, 2]],
    [?assertEqual([P1], actor_nif:lookup(<<"b">>)) || _ <- [1, 2]],
    %% Many keys, more than the key cache has slots, and keys around its
    %% longest (64 bytes): each its own answer.
    Keys = [{<<"key-", (integer_to_binary(I))/binary>>, lists:sublist([P1, P2, P3], 1 + I rem 3)}
            || I <- lists:seq(1, 400)]
        ++ [{binary:copy(<<"L">>, N), lists:sublist([P3, P2, P1], 1 + N rem 3)}
            || N <- [7, 8, 9, 63, 64, 65, 200]],
    Many = name(Ctx),
    write_seg(Many, segment(#{arena => 1 bsl 20,
                              half0 => [{K, term_to_binary(V)} || {K, V} <- Keys]})),
    ok = actor_nif:attach(Many, ?NODE),
    [?assertEqual(V, actor_nif:lookup(K)) || _ <- [1, 2], {K, V} <- Keys],
    %% No label: every lookup looks, counted or not.
    Zero = name(Ctx),
    write_seg(Zero, segment(#{changes => 0, half0 => V1})),
    ok = actor_nif:attach(Zero, ?NODE),
    [?assertEqual([P1], actor_nif:lookup(<<"a">>)) || _ <- [1, 2]],
    pwrite_half(Zero, 0, V2),
    ?assertEqual([P3, P1], actor_nif:lookup(<<"a">>)),
    [rm(N) || N <- [Name, Many, Zero]].

%% Two segments with the same layout, the same gen, offsets and counter but
%% other values: only the mapping tells the cached answers apart.
key_cache_never_survives_a_reattach(#{pids := Pids} = Ctx) ->
    {PidsA, PidsB} = lists:split(5, Pids),
    A = name(Ctx),
    B = name(Ctx),
    write_seg(A, segment(#{changes => 5, half0 => [{<<"k">>, term_to_binary(PidsA)}]})),
    write_seg(B, segment(#{changes => 5, half0 => [{<<"k">>, term_to_binary(PidsB)}]})),
    lists:foreach(fun(N) ->
                          ok = actor_nif:attach(N, ?NODE),
                          Expect = case N of A -> PidsA; B -> PidsB end,
                          [?assertEqual(Expect, actor_nif:lookup(<<"k">>)) || _ <- [1, 2, 3]]
                  end, [A, B, A, B]),
    %% Another segment under the same name: a new mapping too.
    rm(A),
    write_seg(A, segment(#{changes => 5, half0 => [{<<"k">>, term_to_binary(PidsB)}]})),
    ok = actor_nif:attach(A, ?NODE),
    [?assertEqual(PidsB, actor_nif:lookup(<<"k">>)) || _ <- [1, 2]],
    ok = actor_nif:detach(),
    ?assertEqual({error, unmapped}, actor_nif:lookup(<<"k">>)),
    rm(A),
    rm(B).

%% The state is read on every lookup, cached or not: STALE (or CLOSED, or
%% junk) with the counter unchanged is {error, stale}; LIVE again answers.
key_cache_honours_the_state(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{<<"k">>, pids_val(Ctx)}]})),
    ok = actor_nif:attach(Name, ?NODE),
    [?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)) || _ <- [1, 2, 3]],
    [?assertEqual([], actor_nif:lookup(<<"none">>)) || _ <- [1, 2, 3]],
    C = changes(Name),
    lists:foreach(fun(State) ->
                          pwrite_state(Name, State),
                          ?assertEqual(C, changes(Name)),
                          ?assertEqual({error, stale}, actor_nif:lookup(<<"k">>)),
                          ?assertEqual({error, stale}, actor_nif:lookup(<<"none">>)),
                          pwrite_state(Name, ?LIVE),
                          ?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)),
                          ?assertEqual([], actor_nif:lookup(<<"none">>))
                  end, [?STALE, ?CLOSED, 77]),
    rm(Name).

%% Lookups on every scheduler while the mapping is replaced over and over:
%% each answer is the old segment's or the new one's, never anything else.
%% Fewer than 64 re-attaches, so no region a looker may hold is unmapped
%% (see many_reattaches_retire_old_mappings for that).
reattach_while_others_look_up(#{pids := Pids} = Ctx) ->
    {PidsA, PidsB} = lists:split(4, Pids),
    A = name(Ctx),
    B = name(Ctx),
    Big = [self() || _ <- lists:seq(1, 3000)],
    write_seg(A, segment(#{arena => 1 bsl 20,
                           half0 => [{<<"k">>, term_to_binary(PidsA)},
                                     {<<"big">>, term_to_binary(Big)}]})),
    write_seg(B, segment(#{arena => 1 bsl 20,
                           half0 => [{<<"x">>, term_to_binary([self()])},
                                     {<<"k">>, term_to_binary(PidsB)},
                                     {<<"big">>, term_to_binary(Big)}]})),
    ok = actor_nif:attach(A, ?NODE),
    Parent = self(),
    Lookers = [spawn_link(fun() -> looker(Parent, K, [PidsA, PidsB, Big], 0, 0) end)
               || K <- [<<"k">>, <<"k">>, <<"k">>, <<"big">>]],
    lists:foreach(fun(I) ->
                          N = case I rem 2 of 0 -> A; 1 -> B end,
                          ok = actor_nif:attach(N, ?NODE),
                          Expect = case N of A -> PidsA; B -> PidsB end,
                          ?assertEqual(Expect, actor_nif:lookup(<<"k">>)),
                          receive after 2 -> ok end
                  end, lists:seq(1, 60)),
    [L ! stop || L <- Lookers],
    Counts = [receive {looked, L, Good, Bad} -> {Good, Bad} end || L <- Lookers],
    ?assertEqual([0 || _ <- Lookers], [Bad || {_, Bad} <- Counts]),
    ?assert(lists:all(fun({Good, _}) -> Good > 0 end, Counts)),
    rm(A),
    rm(B).

looker(Parent, Key, Expected, Good, Bad) ->
    receive
        stop ->
            Parent ! {looked, self(), Good, Bad}
    after 0 ->
            R = actor_nif:lookup(Key),
            case lists:member(R, Expected) of
                true -> looker(Parent, Key, Expected, Good + 1, Bad);
                false -> looker(Parent, Key, Expected, Good, Bad + 1)
            end
    end.

%% Replaced mappings give their segment back at once (their pages become
%% private zero pages: /proc/self/maps shows only the current segment) and
%% their regions are unmapped later: beyond 1024 of them, or beyond 64 once
%% the oldest is a second old. The current one keeps answering throughout.
many_reattaches_retire_old_mappings(#{prefix := Prefix} = Ctx) ->
    Names = [name(Ctx) || _ <- lists:seq(1, 3)],
    [write_seg(N, segment(#{half0 => [{<<"k">>, term_to_binary([self()])},
                                      {N, term_to_binary([])}]}))
     || N <- Names],
    #{retired := R0} = actor_nif:info(),
    Attach = fun(I) ->
                     N = lists:nth(1 + I rem 3, Names),
                     ok = actor_nif:attach(N, ?NODE),
                     ?assertEqual([self()], actor_nif:lookup(<<"k">>)),
                     ?assertEqual([], actor_nif:lookup(N))
             end,
    lists:foreach(Attach, lists:seq(1, 1100)),
    ?assertEqual(1, length(segment_maps(Prefix))),
    receive after 1100 -> ok end,
    Attach(0),
    #{retired := R1} = actor_nif:info(),
    ?assertEqual(1100, R1 - R0),
    ok = actor_nif:detach(),
    ?assertEqual([], segment_maps(Prefix)),
    [rm(N) || N <- Names].

%% A listing with a remote pid is cached as a term (copied out on a hit).
remote_pids_are_answered(Ctx) ->
    Node = binary_to_atom(<<"ap_nif_remote@nowhere">>),
    Remote = binary_to_term(<<131, 88, 119, (byte_size(atom_to_binary(Node))),
                              (atom_to_binary(Node))/binary, 42:32, 0:32, 7:32>>),
    ?assertEqual(Node, node(Remote)),
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{<<"r">>, term_to_binary([self(), Remote])},
                                        {<<"rr">>, term_to_binary([Remote, Remote])}]})),
    ok = actor_nif:attach(Name, ?NODE),
    [?assertEqual([self(), Remote], actor_nif:lookup(<<"r">>)) || _ <- [1, 2, 3]],
    [?assertEqual([Remote, Remote], actor_nif:lookup(<<"rr">>)) || _ <- [1, 2, 3]],
    rm(Name).

%% Loading a new version of the module reuses the same library image (an
%% upgrade): the mapping survives, and purging the old version must not
%% free it. Unloading the last version frees everything; loading again
%% starts afresh (new thread caches, nothing mapped).
reload_upgrade_and_unload(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{<<"k">>, pids_val(Ctx)}]})),
    ok = actor_nif:attach(Name, ?NODE),
    ?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)),
    {actor_nif, Bin, File} = code:get_object_code(actor_nif),
    {module, actor_nif} = code:load_binary(actor_nif, File, Bin),
    ?assert(actor_nif:loaded()),
    ?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)),
    ?assert(code:soft_purge(actor_nif)),
    ?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)),
    ?assertMatch(#{mapped := true, path := Name}, actor_nif:info()),
    ?assert(code:delete(actor_nif)),
    ?assert(code:soft_purge(actor_nif)),
    {module, actor_nif} = code:ensure_loaded(actor_nif),
    ?assert(actor_nif:loaded()),
    ?assertEqual({error, unmapped}, actor_nif:lookup(<<"k">>)),
    ok = actor_nif:attach(Name, ?NODE),
    [?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)) || _ <- [1, 2]],
    rm(Name).

detach_unmaps(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, segment(#{half0 => [{<<"k">>, pids_val(Ctx)}]})),
    ok = actor_nif:attach(Name, ?NODE),
    ?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)),
    #{retired := R0} = actor_nif:info(),
    ?assertEqual(ok, actor_nif:detach()),
    ?assertEqual({error, unmapped}, actor_nif:lookup(<<"k">>)),
    ?assertEqual(#{mapped => false, retired => R0 + 1}, actor_nif:info()),
    ?assertEqual(ok, actor_nif:detach()),
    ?assertEqual(#{mapped => false, retired => R0 + 1}, actor_nif:info()),
    rm(Name).

info_describes_the_mapping(Ctx) ->
    Name = name(Ctx),
    write_seg(Name, segment(#{gen => 6, heartbeat_ms => 123456, writer_pid => 4242,
                              incarnation => 17,
                              half0 => [{<<"k">>, pids_val(Ctx)}]})),
    ok = actor_nif:attach(Name, ?NODE),
    ?assertEqual(#{mapped => true, path => Name, node => ?NODE, gen => 6, state => live,
                   writer_pid => 4242, incarnation => 17, heartbeat_ms => 123456,
                   retired => maps:get(retired, actor_nif:info())},
                 actor_nif:info()),
    pwrite_gen(Name, 8),
    ?assertMatch(#{gen := 8}, actor_nif:info()),
    ?assertEqual(pids(Ctx), actor_nif:lookup(<<"k">>)),
    rm(Name).

%% ===================================================================
%% Segment encoder (c_src/shm/ap_shm.h)
%% ===================================================================

%% A whole segment: the header, then half 0 and half 1, each holding its
%% own list of {Key, Value} entries in append order (a later entry for a key
%% replaces the earlier one in the index, like the writer's updates).
segment(Opts) ->
    ArenaSize = maps:get(arena, Opts, ?ARENA),
    HalfSize = half_size(ArenaSize),
    SegSize = ?HDR_SIZE + 2 * HalfSize,
    Hdr = header(Opts#{seg_size => SegSize, half_size => HalfSize}),
    H0 = half(maps:get(half0, Opts, []), ArenaSize),
    H1 = half(maps:get(half1, Opts, []), ArenaSize),
    <<Hdr/binary, H0/binary, H1/binary>>.

half_size(ArenaSize) ->
    ?HALF_HDR + ?CAP * 8 + ArenaSize.

header(O) ->
    Node = maps:get(node, O, ?NODE),
    Bin = <<?MAGIC:64/native, ?VERSION:32/native, ?HDR_SIZE:32/native,
            (maps:get(seg_size, O)):64/native, (maps:get(half_size, O)):64/native,
            (maps:get(gen, O, 0)):64/native, (maps:get(heartbeat_ms, O, 1)):64/native,
            (maps:get(writer_pid, O, 1)):64/native, (maps:get(incarnation, O, 1)):64/native,
            (maps:get(state, O, ?LIVE)):32/native, 0:32, (maps:get(changes, O, 1)):64/native,
            ?SEED:64/native, (pad_to(Node, 256))/binary>>,
    pad_to(Bin, ?HDR_SIZE).

half(Entries, ArenaSize) ->
    {Arena, Offs, Order} =
        lists:foldl(fun({K, V}, {Acc, Map, Ord}) ->
                            Ord1 = case maps:is_key(K, Map) of
                                       true -> Ord;
                                       false -> [K | Ord]
                                   end,
                            {<<Acc/binary, (entry(K, V))/binary>>,
                             Map#{K => byte_size(Acc)}, Ord1}
                    end, {<<0:64>>, #{}, []}, Entries),
    true = byte_size(Arena) =< ArenaSize,
    Slots = lists:foldl(fun(K, S) -> place(K, maps:get(K, Offs), S) end,
                        #{}, lists:reverse(Order)),
    Index = << <<(maps:get(I, Slots, 0)):64/native>> || I <- lists:seq(0, ?CAP - 1) >>,
    <<?CAP:64/native, (?HALF_HDR + ?CAP * 8):64/native, ArenaSize:64/native,
      (byte_size(Arena)):64/native, (map_size(Offs)):64/native, 0:192,
      Index/binary, (pad_to(Arena, ArenaSize))/binary>>.

%% Linear probing from hash & (cap - 1).
place(Key, Off, Slots) ->
    H = hash(Key),
    probe(H band (?CAP - 1), ((H bsr 32) bsl 32) bor (Off div 8), Slots).

probe(I, Slot, Slots) ->
    case maps:is_key(I, Slots) of
        true -> probe((I + 1) band (?CAP - 1), Slot, Slots);
        false -> Slots#{I => Slot}
    end.

entry(K, V) ->
    <<(hash(K)):64/native, (byte_size(K)):32/native, (byte_size(V)):32/native,
      (pad8(K))/binary, (pad8(V))/binary>>.

%% Where things are in the file.
slot_pos(Half, Key) when is_binary(Key) ->
    slot_pos(Half, hash(Key) band (?CAP - 1));
slot_pos(Half, I) ->
    half_pos(Half, ?ARENA) + ?HALF_HDR + I * 8.

entry_pos(Half, Off) ->
    entry_pos(Half, Off, ?ARENA).

entry_pos(Half, Off, ArenaSize) ->
    half_pos(Half, ArenaSize) + ?HALF_HDR + ?CAP * 8 + Off.

half_pos(Half, ArenaSize) ->
    ?HDR_SIZE + Half * half_size(ArenaSize).

%% ap_shm_hash from c_src/shm/ap_shm.c with this module's seed.
hash(Key) ->
    hash(?SEED, Key).

%% ap_shm_hash(Seed, Key): SipHash-1-3 with the key (Seed, Seed bxor K1).
hash(Seed, Key) ->
    siphash(1, 3, Seed, Seed bxor 16#9e3779b97f4a7c15, Key).

%% SipHash-C-D over 64-bit words (band ?MASK64 after every add and shift),
%% the message read as little-endian words.
siphash(C, D, K0, K1, Msg) ->
    V = {K0 bxor 16#736f6d6570736575, K1 bxor 16#646f72616e646f6d,
         K0 bxor 16#6c7967656e657261, K1 bxor 16#7465646279746573},
    sip_blocks(C, D, V, Msg, byte_size(Msg)).

sip_blocks(C, D, {V0, V1, V2, V3}, <<M:64/little, Rest/binary>>, Len) ->
    {W0, W1, W2, W3} = sip_rounds(C, {V0, V1, V2, V3 bxor M}),
    sip_blocks(C, D, {W0 bxor M, W1, W2, W3}, Rest, Len);
sip_blocks(C, D, {V0, V1, V2, V3}, Tail, Len) ->
    B = ((Len band 16#ff) bsl 56) bor binary:decode_unsigned(Tail, little),
    {W0, W1, W2, W3} = sip_rounds(C, {V0, V1, V2, V3 bxor B}),
    {X0, X1, X2, X3} = sip_rounds(D, {W0 bxor B, W1, W2 bxor 16#ff, W3}),
    X0 bxor X1 bxor X2 bxor X3.

sip_rounds(0, V) ->
    V;
sip_rounds(N, {V0, V1, V2, V3}) ->
    A0 = (V0 + V1) band ?MASK64, A1 = rotl(V1, 13) bxor A0, B0 = rotl(A0, 32),
    A2 = (V2 + V3) band ?MASK64, A3 = rotl(V3, 16) bxor A2,
    C0 = (B0 + A3) band ?MASK64, B3 = rotl(A3, 21) bxor C0,
    B2 = (A2 + A1) band ?MASK64, B1 = rotl(A1, 17) bxor B2, C2 = rotl(B2, 32),
    sip_rounds(N - 1, {C0, B1, C2, B3}).

rotl(X, B) ->
    ((X bsl B) bor (X bsr (64 - B))) band ?MASK64.

pad8(B) ->
    pad_to(B, (byte_size(B) + 7) band -8).

pad_to(B, N) when byte_size(B) =< N ->
    <<B/binary, 0:((N - byte_size(B)) * 8)>>.

patch(Bin, Pos, New) ->
    <<Pre:Pos/binary, _:(byte_size(New))/binary, Post/binary>> = Bin,
    <<Pre/binary, New/binary, Post/binary>>.

corrupt(Bin, Regions) ->
    {Start, Len} = lists:nth(rand:uniform(length(Regions)), Regions),
    Pos = Start + rand:uniform(Len) - 1,
    New = case rand:uniform(4) of
              1 -> <<(rand:uniform(256) - 1)>>;
              2 -> <<16#FF>>;
              3 -> <<0>>;
              4 -> <<(binary:at(Bin, Pos) bxor (1 bsl (rand:uniform(8) - 1)))>>
          end,
    patch(Bin, Pos, New).

%% remove_segment/1 unlinks a snapshot no writer holds the lock of (these
%% files were never locked: their writer is gone), and nothing else: not
%% a FIFO (without waiting for a writer to open it), not a symlink (nor
%% what it points to), not a file of ours that is no snapshot.
remove_segment_takes_only_a_dead_writers_snapshot(Ctx) ->
    Seg = segment(#{half0 => [{<<"k">>, pids_val(Ctx)}]}),
    Dead = name(Ctx),
    ?assertEqual({error, enoent}, actor_nif:remove_segment(Dead)),
    write_seg(Dead, Seg),
    ?assertEqual(ok, actor_nif:remove_segment(Dead)),
    ?assertNot(filelib:is_file(shm_path(Dead))),
    Fifo = name(Ctx),
    "" = os:cmd("mkfifo " ++ shm_path(Fifo)),
    ?assertEqual({error, not_ours}, actor_nif:remove_segment(Fifo)),
    ?assertMatch({ok, _}, file:read_link_info(shm_path(Fifo))),
    Target = name(Ctx),
    Link = name(Ctx),
    write_seg(Target, Seg),
    ok = file:make_symlink(shm_path(Target), shm_path(Link)),
    ?assertEqual({error, not_ours}, actor_nif:remove_segment(Link)),
    ?assert(filelib:is_file(shm_path(Target))),
    ?assertMatch({ok, _}, file:read_link_info(shm_path(Link))),
    Junk = name(Ctx),
    write_seg(Junk, <<"junk, not a snapshot">>),
    ?assertEqual({error, not_a_snapshot}, actor_nif:remove_segment(Junk)),
    ?assertError(badarg, actor_nif:remove_segment(<<"no_slash">>)),
    ?assertError(badarg, actor_nif:remove_segment(<<"/a/b">>)),
    ?assertError(badarg, actor_nif:remove_segment(<<>>)),
    ?assertError(badarg, actor_nif:remove_segment("/x")),
    [ok = file:delete(shm_path(N)) || N <- [Fifo, Target, Link, Junk]],
    ok.

%% ===================================================================
%% Files and helpers
%% ===================================================================

name(#{prefix := Prefix}) ->
    list_to_binary(["/", Prefix, integer_to_list(erlang:unique_integer([positive]))]).

shm_path(Name) ->
    "/dev/shm" ++ binary_to_list(Name).

%% Only for fresh names: never rewrite a file that may be mapped.
write_seg(Name, Bin) ->
    Path = shm_path(Name),
    false = filelib:is_file(Path),
    ok = file:write_file(Path, Bin),
    ok = file:change_mode(Path, 8#600).

pwrite(Name, Pos, Bin) ->
    {ok, Fd} = file:open(shm_path(Name), [read, write, raw, binary]),
    ok = file:pwrite(Fd, Pos, Bin),
    ok = file:close(Fd).

pwrite_half(Name, Half, Entries) ->
    pwrite(Name, half_pos(Half, ?ARENA), half(Entries, ?ARENA)).

pwrite_gen(Name, Gen) ->
    pwrite(Name, ?GEN_POS, <<Gen:64/native>>).

%% The state alone: the writer would count the change too (see count/1).
pwrite_state(Name, State) ->
    pwrite(Name, ?STATE_POS, <<State:32/native>>).

%% What the writer does after each change it published: changes + 1.
count(Name) ->
    {ok, Fd} = file:open(shm_path(Name), [read, write, raw, binary]),
    {ok, <<C:64/native>>} = file:pread(Fd, ?CHANGES_POS, 8),
    ok = file:pwrite(Fd, ?CHANGES_POS, <<(C + 1):64/native>>),
    ok = file:close(Fd).

changes(Name) ->
    {ok, Fd} = file:open(shm_path(Name), [read, raw, binary]),
    {ok, <<C:64/native>>} = file:pread(Fd, ?CHANGES_POS, 8),
    ok = file:close(Fd),
    C.

%% Lines of /proc/self/maps that map one of this run's segments.
segment_maps(Prefix) ->
    {ok, Maps} = file:read_file("/proc/self/maps"),
    [L || L <- binary:split(Maps, <<"\n">>, [global]),
          binary:match(L, list_to_binary(Prefix)) =/= nomatch].

rm(Name) ->
    ok = file:delete(shm_path(Name)).

pids(#{pids := Pids}) ->
    Pids.

pids_val(Ctx) ->
    term_to_binary(pids(Ctx)).
