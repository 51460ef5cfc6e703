%% @doc The BEAM's end of the same-host data plane, in a NIF
%% (`c_src/dataplane/beam/').
%%
%% A segment ({@link seg()}) joins this BEAM to one pool node on the same
%% host: request rings this module writes (one per scheduler), reply rings
%% a thread of the NIF library watches. It hands each ring with answers to
%% a deliverer process ({@link actor_dp_deliverer}, one per scheduler),
%% which sends `{Ref, Answer}' to each asker from its scheduler
%% ({@link drain/2}); with no deliverer running, or for an answer over
%% 64 KiB, the thread sends it itself with `enif_send'. The layout and the
%% attach handshake are `c_src/ring/ap_seg.h''s;
%% `docs/same-host-transport.md' has the design.
%% This module is thin: lanes are `actor_pool_dp''s; the choice of ring or
%% distribution per call, and ordering across the two, are
%% `actor_pool_transport''s.
%%
%% The pool node is not trusted: whatever it writes in the segment yields
%% errors (`bad_records' counted, the segment closed with `bad_segment'),
%% never a VM crash.
%%
%% Lifetime: a segment stays open until {@link close/2}, the pool node's
%% end (EOF on the attach socket, a broken ring: the owner gets
%% `{actor_dp, Seg, down, Reason}' and every pending ask
%% `{Ref, {error, Reason}}'), or the exit of its owner process. Its memory
%% is freed once it is closed and no term refers to it.
%%
%% The NIF library is `priv/actor_dp.so' (or the file named by the
%% environment variable `ACTOR_DP_NIF', without its extension: the ASan
%% build in tests). If it cannot be loaded the module still loads, with a
%% warning: {@link loaded/0} is then `false' and the other functions raise
%% `error:not_loaded'.
-module(actor_dp).

-export([open/3]).
-export([submit/6, submit/7, submit_encoded/6]).
-export([await/2, await/3]).
-export([drain/2, deliver_for/2]).
-export([cancel/2]).
-export([admit_atoms/2]).
-export([mark/2]).
-export([consumed/2]).
-export([close/2]).
-export([info/1]).
-export([scribble/3]).
-export([loaded/0]).
-export([hist_new/0, hist_add/2, hist_read/1]).

-export_type([seg/0, ticket/0, mark/0, ask_id/0, ask_tag/0, open_opts/0, open_error/0, info/0,
              hist/0]).

-on_load(init/0).

%% open/3's `new_atoms': as many atoms as 64 pools could make at the
%% default max_reply_atoms (1024); what a pool node that ignores its pools'
%% budgets can make this VM keep, per segment.
-define(NEW_ATOMS, 65536).

-opaque seg() :: reference().
%% A segment (a NIF resource).

-opaque ticket() :: non_neg_integer().
%% The request ring a submit's record went to.

-opaque mark() :: non_neg_integer().
%% A place in a request ring ({@link mark/2}), for {@link consumed/2}.

-type ask_id() :: non_neg_integer().

-type ask_tag() :: reference() | {reference(), 1..4294967295}
                 | {reference(), 0..4294967295, hist()} | undefined.
%% What an answer carries ({@link submit/6}): a reference, with the
%% timeout in ms the NIF keeps for the ask (0 in the 3-tuple: none), and a
%% histogram that the ask's round trip is added to ({@link hist_new/0});
%% `undefined' for a tell.

-opaque hist() :: reference().
%% A histogram of round trips ({@link hist_new/0}), a NIF resource.

-type open_opts() :: #{req_rings => pos_integer(),
                       req_bytes => pos_integer(),
                       rep_rings => pos_integer(),
                       rep_bytes => pos_integer(),
                       owner => pid(),
                       node => atom(),
                       timeout => non_neg_integer(),
                       new_atoms => 1..1073741824}.
%% `req_rings' (default: the number of schedulers) request rings of
%% `req_bytes' (a power of two, default 1 MiB) each; `rep_rings' (default
%% 2) reply rings of `rep_bytes' (default 4 MiB); `owner' (default the
%% caller) gets `{actor_dp, Seg, down, Reason}' and its exit closes the
%% segment; `node' (default `undefined') is the pool node, for the
%% `{nodedown, Node}' answers; `timeout' bounds the attach (default 2000 ms);
%% `new_atoms' (default 65536) is how many atoms the segment's answers may
%% make in this VM (see {@link admit_atoms/2}).

-type open_error() :: econnrefused | enoent | etimedout | eperm | eproto | econnreset | enomem
                    | einval | emfile | noproc | {refused, atom() | {errno, integer()}}
                    | {errno, integer()}.
%% `econnrefused': no such socket (the pool node is gone or runs without
%% the fast path); `eperm': the socket belongs to another user;
%% `{refused, Why}': the pool node refused the attach (`eperm': bad
%% token; `emfile': too many segments); `einval': a bad geometry.

-type info() :: #{state := open | closed,
                  tells := non_neg_integer(),
                  asks := non_neg_integer(),
                  stats := non_neg_integer(),
                  replies := non_neg_integer(),
                  late := non_neg_integer(),
                  bad_records := non_neg_integer(),
                  full := non_neg_integer(),
                  too_large := non_neg_integer(),
                  encoded := non_neg_integer(),
                  awaited := non_neg_integer(),
                  await_missed := non_neg_integer(),
                  passed_on := non_neg_integer(),
                  sched_delivered := non_neg_integer(),
                  timeouts := non_neg_integer(),
                  unsafe_decodes := non_neg_integer(),
                  new_atoms := non_neg_integer(),
                  pending := non_neg_integer(),
                  req_rings := pos_integer(),
                  rep_rings := pos_integer(),
                  req_bytes := pos_integer(),
                  rep_bytes := pos_integer(),
                  size := pos_integer()}.
%% Counters since open: records submitted per kind, replies delivered,
%% `late' (replies for a cancelled or unknown ask, dropped), `bad_records'
%% (reply records with a bad header, skipped), `full' and `too_large'
%% (submits refused), `encoded' (records submitted by {@link
%% submit_encoded/6}), `awaited' (answers taken by {@link await/2}),
%% `await_missed' (waits that ended without one), `passed_on' (others'
%% answers an awaiting asker sent on), `sched_delivered' (answers
%% deliverer processes sent), `timeouts' (asks answered `{error, timeout}'
%% by the NIF at their deadline), `unsafe_decodes' (answers decoded with
%% new atoms allowed, see {@link admit_atoms/2}) and `new_atoms' (the atom
%% names admitted for them), `pending' asks now; and the geometry.

%% ===================================================================
%% API
%% ===================================================================

%% @doc Creates a segment and attaches it to the pool node listening on
%% `Socket' (an abstract AF_UNIX name, `<<0, Name/binary>>') with `Token'
%% (16 bytes), both from the pool node's `dp_info'. Runs on a dirty I/O
%% scheduler; bounded by the `timeout' option.
-spec open(Socket :: binary(), Token :: binary(), Opts :: open_opts()) ->
          {ok, seg()} | {error, open_error()}.
open(Socket, Token, Opts) when is_binary(Socket), is_binary(Token), is_map(Opts) ->
    Geometry = {maps:get(req_rings, Opts, erlang:system_info(schedulers)),
                maps:get(req_bytes, Opts, 1 bsl 20),
                maps:get(rep_rings, Opts, 2),
                maps:get(rep_bytes, Opts, 4 bsl 20)},
    open_nif(Socket, Token, atom_to_binary(node(), utf8), Geometry,
             maps:get(owner, Opts, self()), maps:get(node, Opts, undefined),
             maps:get(timeout, Opts, 2000), maps:get(new_atoms, Opts, ?NEW_ATOMS)).

%% @doc Writes one request into this scheduler's request ring (or another
%% free one) and rings the pool node. `Dest' is the pool's registered name
%% (a Latin-1 atom) or pid. A binary `Msg' travels as itself; another term
%% as its external format. `Ref' (a reference, for `ask' and `stats'; else
%% ignored) is what the answer `{Ref, Answer}' carries; `{Ref, TimeoutMs}'
%% (1..4294967295) makes the NIF keep the ask's timeout: if no answer came
%% within `TimeoutMs' it sends `{Ref, {error, timeout}}' and drops the
%% answer that comes later, so the caller waits with no `after' of its own
%% (and no timer). `Ticket' is the
%% caller's previous ticket for this segment (or `undefined'): when it
%% names another ring the record carries a fence, that ring's end now, so
%% the pool node reads that ring up to there first and the caller's order
%% holds. The ticket is the ring only: it changes when the caller moves to
%% another ring, not with each record. A ticket of an earlier segment to
%% the same pool node makes a fence too, which costs nothing but a read of
%% that ring the reader would do anyway.
%%
%% `full': no room in the ring now (yield and retry, or give up);
%% `too_large': over the ring's record size; `closed': the segment is
%% closed. An ask is answered exactly once, unless cancelled. An answer
%% that holds a map of more than 32 keys, or whose bytes the NIF's walk
%% does not vouch for, comes as `{Ref, {'$actor_dp_ext', ExternalBytes}}'
%% (decode it with `binary_to_term(Bytes, [safe])', and without `safe' only
%% when {@link admit_atoms/2} says so): the reply thread cannot decode
%% such maps on OTP before 27.3 (erlang/otp#8208). An ask that
%% is the segment's only pending one, and follows no other process's ask
%% within 1 ms, gets `{ok, Ticket, AskId, await}': worth a call of
%% {@link await/2} (unless its last waits ended empty: then the next 4, 8,
%% ... up to 256 such asks are not marked).
%%
%% `encode': nothing was done, because `Msg' is too large to encode inside
%% this call without holding the scheduler (a walk of a few thousand of its
%% terms, or a bound of about 64 KiB of its encoded size, was not enough;
%% also funs, integers over 64 bits and bitstrings that are not binaries).
%% Encode it with `term_to_binary/1', which yields, and submit the bytes
%% with {@link submit_encoded/6}. A binary `Msg' is never answered
%% `encode': it is not encoded, and refused on its size alone.
-spec submit(Seg :: seg(), Kind :: tell | ask | stats, Dest :: atom() | pid(), Msg :: term(),
             Ref :: ask_tag(), Ticket :: ticket() | undefined) ->
          {ok, ticket()} | {ok, ticket(), ask_id()} | {ok, ticket(), ask_id(), await}
          | full | too_large | closed | encode.
submit(_Seg, _Kind, _Dest, _Msg, _Ref, _Ticket) ->
    erlang:nif_error(not_loaded).

%% @doc As {@link submit/6}, with `Bound', an upper bound of the size of
%% `Msg' in the external format that the caller has at hand (actor_pool's
%% walk of every message gives one): at most 16 KiB, it stands for the
%% NIF's own walk of `Msg' (which then is encoded in the call). A wrong
%% bound only makes the call take longer.
-spec submit(Seg :: seg(), Kind :: tell | ask | stats, Dest :: atom() | pid(), Msg :: term(),
             Ref :: ask_tag(), Ticket :: ticket() | undefined,
             Bound :: non_neg_integer()) ->
          {ok, ticket()} | {ok, ticket(), ask_id()} | {ok, ticket(), ask_id(), await}
          | full | too_large | closed | encode.
submit(_Seg, _Kind, _Dest, _Msg, _Ref, _Ticket, _Bound) ->
    erlang:nif_error(not_loaded).

%% @doc As {@link submit/6} (`tell' or `ask'), for a message already
%% encoded: `Bin' is `term_to_binary(Msg)' (not compressed), and the pool
%% node gets `Msg' as if it were passed to submit/6, in the same order with
%% the caller's other submits (the same tickets and fences). `too_large'
%% is answered on the size of `Bin' alone. Raises `badarg' when `Bin' is
%% not a binary holding exactly one external term (truncated, bytes after
%% it, compressed, not a term): the pool node would skip such a record.
%% The bytes are checked on a dirty CPU scheduler when there are more than
%% 64 KiB of them.
-spec submit_encoded(Seg :: seg(), Kind :: tell | ask, Dest :: atom() | pid(), Bin :: binary(),
                     Ref :: ask_tag(), Ticket :: ticket() | undefined) ->
          {ok, ticket()} | {ok, ticket(), ask_id()} | {ok, ticket(), ask_id(), await}
          | full | too_large | closed.
submit_encoded(_Seg, _Kind, _Dest, _Bin, _Ref, _Ticket) ->
    erlang:nif_error(not_loaded).

%% @doc Waits briefly, on the caller's scheduler, for the answer to ask
%% `AskId' and takes it: `{reply, Answer}', after which no message comes
%% for it. For an ask whose submit answered `{ok, Ticket, AskId, await}';
%% only while it is still the segment's only pending one (a lone caller:
%% its scheduler has nothing else to run), for at most 150 us; `none' at
%% once otherwise, and for the asker only. An answer over 64 KiB is left
%% to the reply thread (no long decode on a scheduler). After `none' the
%% answer comes as `{Ref, Answer}', as without this call (or was already
%% sent).
-spec await(Seg :: seg(), AskId :: ask_id()) -> {reply, term()} | none.
await(_Seg, _AskId) ->
    erlang:nif_error(not_loaded).

%% @doc As {@link await/2}, for at most `Us' microseconds (0..1000), for
%% any ask that is the only one pending (whoever asked just before), and
%% without counting towards the gap after empty waits. For tests and
%% tuning.
-spec await(Seg :: seg(), AskId :: ask_id(), Us :: 0..1000) -> {reply, term()} | none.
await(_Seg, _AskId, _Us) ->
    erlang:nif_error(not_loaded).

%% @doc For a deliverer process, on `{actor_dp_drain, Seg, Ring}' (the
%% reply thread's hand-over of reply ring `Ring'): sends each answer
%% waiting in that ring (at most 512) to its asker from the caller's
%% scheduler, as the reply thread would. An answer over 64 KiB, or one the
%% reply thread or an awaiting asker holds, is left to the reply thread.
-spec drain(Seg :: seg(), Ring :: non_neg_integer()) -> ok.
drain(_Seg, _Ring) ->
    erlang:nif_error(not_loaded).

%% @doc Makes the calling process deliverer `Index' (0-based) of `Count'
%% (at most 64): the reply threads of every segment hand it reply rings
%% from now on, until a send to it fails (it is gone) or another process
%% takes its index. A new `Count' forgets the others.
-spec deliver_for(Index :: non_neg_integer(), Count :: pos_integer()) -> ok.
deliver_for(_Index, _Count) ->
    erlang:nif_error(not_loaded).

%% @doc Whether an answer's external bytes (from `{'$actor_dp_ext', Bytes}')
%% that `binary_to_term(Bytes, [safe])' refused may be decoded with new
%% atoms: `true' when each atom in it exists already or fits in the
%% segment's allowance (the `new_atoms' option of {@link open/3}; the
%% admitted names count against it from then on), `false' otherwise (also
%% for bytes that are no term the pool node's check takes). Answers the NIF
%% decodes itself go by the same rule: one that is refused is
%% `{error, bad_reply}'. A pool node checks its pools' replies against their
%% `max_reply_atoms' first; this is the bound for one that does not.
-spec admit_atoms(Seg :: seg(), Bytes :: binary()) -> boolean().
admit_atoms(_Seg, _Bytes) ->
    erlang:nif_error(not_loaded).

%% @doc Forgets a pending ask: `true' if it was still pending (no answer
%% will ever be sent), `false' if its answer was already sent (it is in the
%% asker's mailbox: flush it) or the id is unknown.
-spec cancel(Seg :: seg(), AskId :: ask_id()) -> boolean().
cancel(_Seg, _AskId) ->
    erlang:nif_error(not_loaded).

%% @doc Where the ring of `Ticket' ends now: everything the caller put
%% there is before it. `closed' once the segment is closed.
-spec mark(Seg :: seg(), Ticket :: ticket()) -> mark() | closed.
mark(_Seg, _Ticket) ->
    erlang:nif_error(not_loaded).

%% @doc Whether the pool node has read everything up to `Mark' (its
%% consumer has passed it); `closed' once the segment is closed.
-spec consumed(Seg :: seg(), Mark :: mark()) -> boolean() | closed.
consumed(_Seg, _Mark) ->
    erlang:nif_error(not_loaded).

%% @doc Closes the segment: every pending ask gets `{Ref, {error, Reason}}'
%% at once, the reply thread stops, the pool node sees EOF, later submits
%% return `closed'. Idempotent.
-spec close(Seg :: seg(), Reason :: term()) -> ok.
close(_Seg, _Reason) ->
    erlang:nif_error(not_loaded).

%% @doc Counters and geometry (see {@link info()}).
-spec info(Seg :: seg()) -> info().
info(_Seg) ->
    erlang:nif_error(not_loaded).

%% @doc A TEST HOOK: writes `Bin' at byte `Offset' of the live segment, as a
%% broken or hostile pool node could. `{error, badarg}' past the end.
-spec scribble(Seg :: seg(), Offset :: non_neg_integer(), Bin :: binary()) -> ok | {error, badarg}.
scribble(_Seg, _Offset, _Bin) ->
    erlang:nif_error(not_loaded).

%% @doc Whether the NIF library is loaded.
-spec loaded() -> boolean().
loaded() ->
    false.

%% @doc A histogram of ask round trips, for asks that name it in their tag
%% (`{Ref, TimeoutMs, Hist}', TimeoutMs 0 for none): each is timed from its
%% submit to its answer, whatever the answer (a reply, a timeout kept
%% here, the segment's close, a cancel), into the buckets of
%% `c_src/common/ap_hist.h' (1, 2.5 and 5 per decade from 1 us to 10 s).
%% Relaxed atomic adds in shards (one per thread that adds), no lock; a
%% segment keeps each histogram its asks named (at most 4096; past that
%% an ask naming a new one is not timed) until the segment goes.
-spec hist_new() -> hist().
hist_new() ->
    erlang:nif_error(not_loaded).

%% @doc Adds a round trip of `Ns' nanoseconds measured elsewhere (an ask
%% by distribution) to `Hist'.
-spec hist_add(hist(), non_neg_integer()) -> ok.
hist_add(_Hist, _Ns) ->
    erlang:nif_error(not_loaded).

%% @doc `{Counts, SumNs}': the round trips per bucket (not cumulative; 23,
%% the last past 10 s) and their sum.
-spec hist_read(hist()) -> {[non_neg_integer()], non_neg_integer()}.
hist_read(_Hist) ->
    erlang:nif_error(not_loaded).

%% ===================================================================
%% Internal functions
%% ===================================================================

-spec open_nif(binary(), binary(), binary(),
               {pos_integer(), pos_integer(), pos_integer(), pos_integer()},
               pid(), atom(), non_neg_integer(), pos_integer()) -> {ok, seg()} | {error, open_error()}.
open_nif(_Socket, _Token, _Name, _Geometry, _Owner, _Node, _Timeout, _NewAtoms) ->
    erlang:nif_error(not_loaded).

%% @private
-spec init() -> ok.
init() ->
    Path = nif_path(),
    actor_pool_priv:nif_loaded(?MODULE, Path, erlang:load_nif(Path, 0), "the same-host fast path is disabled").

-spec nif_path() -> file:filename().
nif_path() ->
    case os:getenv("ACTOR_DP_NIF") of
        Path when is_list(Path), Path =/= "" ->
            filename:rootname(Path, ".so");
        _ ->
            filename:join(actor_pool_priv:dir(), "actor_dp")
    end.
