%% @doc Reader of the receptionist's shared-memory snapshot, in a NIF.
%%
%% The receptionist C node keeps a snapshot of its registry (key to list of
%% pids) in a POSIX shared-memory segment (layout: `c_src/shm/ap_shm.h').
%% This module maps that segment read-only and answers {@link lookup/1} from
%% it in well under a microsecond, without a message to the receptionist.
%%
%% One segment is attached at a time, for the whole node: {@link attach/2}
%% replaces the current one atomically (lookups running on other schedulers
%% meanwhile answer from the old or the new one, never fault). The segment
%% is not trusted: a damaged or hostile one yields `{error, bad_segment}'.
%%
%% The NIF library is `priv/actor_nif.so'. If it cannot be loaded the module
%% still loads (with a warning in the log): {@link loaded/0} then returns
%% `false' and every other function raises `error:not_loaded'; callers are
%% expected to catch that and ask the receptionist instead.
-module(actor_nif).

-export([attach/2]).
-export([detach/0]).
-export([lookup/1]).
-export([info/0]).
-export([loaded/0]).
-export([remove_segment/1]).

-export_type([attach_error/0, lookup_error/0, info/0, remove_error/0]).

-on_load(init/0).

-type attach_error() :: enoent | eacces | bad_segment | wrong_node | too_small | busy
                      | {errno, pos_integer()}.
%% Why {@link attach/2} failed: no such segment; not readable, or writable
%% by another user (see {@link attach/2}); a header that fails the checks;
%% a segment of another receptionist; a file smaller than a header; the
%% writer switched halves during every try of the check (try again); any
%% other `errno' of `shm_open', `fstat' or `mmap'.

-type remove_error() :: enoent | live | not_ours | not_a_snapshot | replaced
                      | {errno, pos_integer()}.
%% Why {@link remove_segment/1} left a segment: no such name; a writer
%% still holds its lock (a layout-3 one: its pid runs); another user's, or
%% not a regular file (a FIFO, a symlink); ours but no snapshot; the name
%% was replaced while it was judged; any other `errno'.

-type lookup_error() :: unmapped | stale | busy | bad_segment | too_big.
%% Why {@link lookup/1} could not answer: no segment attached; the writer
%% marked the snapshot stale (or closed it); the writer kept switching
%% halves during every retry; the segment or the value fails a check; the
%% value is larger than 16 MiB. In every case the receptionist knows.

-type info() :: #{mapped := boolean(),
                  retired := non_neg_integer(),
                  path => binary(),
                  node => binary(),
                  gen => non_neg_integer(),
                  state => live | stale | closed | unknown,
                  writer_pid => non_neg_integer(),
                  incarnation => non_neg_integer(),
                  heartbeat_ms => non_neg_integer()}.
%% `retired' counts the mappings replaced since the library was loaded. The
%% other keys are there only while a segment is mapped: `path' and `node'
%% as attached, the others read live from the segment's header.

%% ===================================================================
%% API
%% ===================================================================

%% @doc Maps the segment `ShmName' (a POSIX shm name, `<<"/name">>') and
%% makes it the current one, replacing any other.
%%
%% The header must pass the checks (a stale segment is accepted: lookups then
%% answer `{error, stale}' until the writer makes it live again) and name
%% `Node', the receptionist's node name. The segment must belong to this
%% OS user and be writable by no one else: whoever can write it can also
%% truncate it, and a read past the end of a truncated mapping kills the VM.
%% On failure the current segment, if any, stays attached. Runs on a dirty
%% I/O scheduler.
-spec attach(ShmName :: binary(), Node :: binary()) -> ok | {error, attach_error()}.
attach(_ShmName, _Node) ->
    erlang:nif_error(not_loaded).

%% @doc Unmaps the current segment, if any. Lookups then answer
%% `{error, unmapped}'.
-spec detach() -> ok.
detach() ->
    erlang:nif_error(not_loaded).

%% @doc The pids listed under `Key' in the current segment; `[]' for a key
%% that is not there.
%%
%% `Key' is a binary of at most 1024 bytes (else `badarg'). Values over
%% 64 KiB are copied and decoded on a dirty CPU scheduler.
-spec lookup(Key :: binary()) -> [pid()] | {error, lookup_error()}.
lookup(_Key) ->
    erlang:nif_error(not_loaded).

%% @doc Describes the current mapping (see {@link info()}).
-spec info() -> info().
info() ->
    erlang:nif_error(not_loaded).

%% @doc Unlinks the segment `ShmName' (`<<"/name">>') if its writer is
%% gone: nobody holds its lock (`c_src/shm/ap_shm.h', "Writers that are
%% gone"). Never follows a symlink nor waits on a FIFO under the name, and
%% unlinks only while holding the lock on the object it judged, if the name
%% still names it: what the C nodes' sweep does. Runs on a dirty I/O
%% scheduler.
-spec remove_segment(ShmName :: binary()) -> ok | {error, remove_error()}.
remove_segment(_ShmName) ->
    erlang:nif_error(not_loaded).

%% @doc Whether the NIF library is loaded (`false' when the module loaded
%% without it).
-spec loaded() -> boolean().
loaded() ->
    false.

%% ===================================================================
%% Internal functions
%% ===================================================================

%% @private
-spec init() -> ok.
init() ->
    Path = filename:join(actor_pool_priv:dir(), "actor_nif"),
    actor_pool_priv:nif_loaded(?MODULE, Path, erlang:load_nif(Path, 0), "snapshot lookups are disabled").
