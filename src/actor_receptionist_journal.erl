%% @private
%% @doc The journal: what this node's receptionist must give every new
%% incarnation of its C node, and every member of the cluster, again.
%%
%% Not a process: ETS tables that {@link actor_receptionist_server} alone
%% writes (they are public only because their owner is another process).
%% Five tables, one `{A, B}' key per pair:
%% <ul>
%% <li>`actor_receptionist_regs' (ordered_set): `{{Id, Ref}, Seq}', this
%%     node's registrations. Seq (a monotonic integer) keeps the
%%     registration order, so that a replay lists the refs of a key in that
%%     order; ordered by pair, so that the refs of one key are found by
%%     that prefix (whether a `{via, actor_receptionist, Name}' name is
%%     taken).</li>
%% <li>`actor_receptionist_watched' (ordered_set): `{{Ref, Id}}', the
%%     registrations that are watched (`register/4' with `watch', or a
%%     `via' name): each is also in the registrations, found by ref for its
%%     death.</li>
%% <li>`actor_receptionist_subs' (ordered_set): `{{Pid, Id}}', this node's
%%     subscriptions, found by subscriber for its death.</li>
%% <li>`actor_receptionist_followed' (ordered_set): `{{Follower, {Id, Ref}}}',
%%     (on a member) the registrations each follower made through it; they
%%     are in the registrations as well, and go when the follower does.</li>
%% <li>`actor_receptionist_bynode' (ordered_set): `{{Node, {Id, Ref}}}', an
%%     index of the registrations whose ref lives on another node, so that
%%     a `nodedown' removes them without a scan.</li>
%% </ul>
%% All but the last are owned by {@link actor_receptionist_sup} and survive
%% a crash of the server (new/0), the watches too: a new server monitors
%% the watched refs again (prune_watched/0); the index is the server's own,
%% rebuilt from the registrations at each of its starts (index/0).
%%
%% Why one key per pair: insert, delete and membership are O(1) (a set) or
%% O(log n) (an ordered_set), however many pairs share A. A bag keyed on A
%% made each of them O(pairs under A): 50K refs under one key took 16 s to
%% register. In an ordered_set the pairs of one A are found by a key
%% prefix, without a scan.
-module(actor_receptionist_journal).

%% The tables' names: this module alone uses them.
-define(REGS, actor_receptionist_regs).
-define(SUBS, actor_receptionist_subs).
-define(FOLLOWED, actor_receptionist_followed).
-define(BYNODE, actor_receptionist_bynode).
-define(WATCHED, actor_receptionist_watched).

%% Tables.
-export([new/0]).
-export([index/0]).

%% Registrations.
-export([registered/2]).
-export([add/2]).
-export([del/2]).
-export([regs/0]).
-export([regs_count/0]).
-export([refs_on/1]).
-export([refs/1]).

%% Watched registrations.
-export([watch/2]).
-export([unwatch/2]).
-export([watched/2]).
-export([is_watched/1]).
-export([watched_ids/1]).
-export([unwatch_all/1]).
-export([watched_count/0]).
-export([prune_watched/0]).

%% Subscriptions.
-export([subscribed/2]).
-export([add_sub/2]).
-export([del_sub/2]).
-export([subs/0]).
-export([subs_of/1]).
-export([del_subs_of/1]).
-export([has_subs/1]).

%% Followers' registrations.
-export([add_followed/3]).
-export([del_followed/3]).
-export([followed/1]).

%% ===================================================================
%% Tables
%% ===================================================================

%% @doc Creates the tables that outlive the server; called by their owner.
-spec new() -> ok.
new() ->
    Tab = [public, named_table, {write_concurrency, false}],
    ?REGS = ets:new(?REGS, [ordered_set | Tab]),
    ?SUBS = ets:new(?SUBS, [ordered_set | Tab]),
    ?FOLLOWED = ets:new(?FOLLOWED, [ordered_set | Tab]),
    ?WATCHED = ets:new(?WATCHED, [ordered_set | Tab]),
    ok.

%% @doc Creates the by-node index, owned by the caller, from the
%% registrations.
-spec index() -> ok.
index() ->
    ?BYNODE = ets:new(?BYNODE, [named_table, ordered_set, protected]),
    true = ets:insert(?BYNODE, [{{node(Ref), {Id, Ref}}} || {Id, Ref} <- regs(),
                                                                 node(Ref) =/= node()]),
    ok.

%% ===================================================================
%% Registrations
%% ===================================================================

-spec registered(binary(), pid()) -> boolean().
registered(Id, Ref) ->
    ets:member(?REGS, {Id, Ref}).

-spec add(binary(), pid()) -> ok.
add(Id, Ref) ->
    true = ets:insert(?REGS, {{Id, Ref}, erlang:unique_integer([monotonic])}),
    _ = node(Ref) =/= node() andalso ets:insert(?BYNODE, {{node(Ref), {Id, Ref}}}),
    ok.

-spec del(binary(), pid()) -> ok.
del(Id, Ref) ->
    true = ets:delete(?REGS, {Id, Ref}),
    _ = node(Ref) =/= node() andalso ets:delete(?BYNODE, {node(Ref), {Id, Ref}}),
    ok.

%% @doc This node's registrations, `[{Id, Ref}]', in registration order.
-spec regs() -> [{binary(), pid()}].
regs() ->
    [P || {P, _} <- lists:keysort(2, ets:tab2list(?REGS))].

-spec regs_count() -> non_neg_integer().
regs_count() ->
    ets:info(?REGS, size).

%% @doc The registrations whose ref lives on Node.
-spec refs_on(node()) -> [{binary(), pid()}].
refs_on(Node) ->
    pairs_of(?BYNODE, Node).

%% @doc The refs registered under Id (in term order).
-spec refs(binary()) -> [pid()].
refs(Id) ->
    ets:select(?REGS, [{{{Id, '$1'}, '_'}, [], ['$1']}]).

%% ===================================================================
%% Watched registrations
%% ===================================================================

%% @doc The registration of Ref under Id is watched (it must be in the
%% registrations).
-spec watch(pid(), binary()) -> ok.
watch(Ref, Id) ->
    true = ets:insert(?WATCHED, {{Ref, Id}}),
    ok.

-spec unwatch(pid(), binary()) -> ok.
unwatch(Ref, Id) ->
    true = ets:delete(?WATCHED, {Ref, Id}),
    ok.

-spec watched(pid(), binary()) -> boolean().
watched(Ref, Id) ->
    ets:member(?WATCHED, {Ref, Id}).

%% @doc Some registration of Ref is watched (one step of the table).
-spec is_watched(pid()) -> boolean().
is_watched(Ref) ->
    case ets:select(?WATCHED, [{{{Ref, '_'}}, [], [true]}], 1) of
        {[true], _} -> true;
        '$end_of_table' -> false
    end.

%% @doc The ids under which Ref's registration is watched.
-spec watched_ids(pid()) -> [binary()].
watched_ids(Ref) ->
    pairs_of(?WATCHED, Ref).

-spec unwatch_all(pid()) -> ok.
unwatch_all(Ref) ->
    true = ets:match_delete(?WATCHED, {{Ref, '_'}}),
    ok.

-spec watched_count() -> non_neg_integer().
watched_count() ->
    ets:info(?WATCHED, size).

%% @doc The watched refs, for a new server to monitor. A watch whose
%% registration is gone (a server that died between the two deletes) goes
%% too.
-spec prune_watched() -> [pid()].
prune_watched() ->
    {Live, Stale} = lists:partition(fun({Ref, Id}) -> registered(Id, Ref) end, pairs(?WATCHED)),
    _ = [unwatch(Ref, Id) || {Ref, Id} <- Stale],
    lists:usort([Ref || {Ref, _} <- Live]).

%% ===================================================================
%% Subscriptions
%% ===================================================================

-spec subscribed(pid(), binary()) -> boolean().
subscribed(Pid, Id) ->
    ets:member(?SUBS, {Pid, Id}).

-spec add_sub(pid(), binary()) -> ok.
add_sub(Pid, Id) ->
    true = ets:insert(?SUBS, {{Pid, Id}}),
    ok.

-spec del_sub(pid(), binary()) -> ok.
del_sub(Pid, Id) ->
    true = ets:delete(?SUBS, {Pid, Id}),
    ok.

%% @doc Every subscription, `[{Pid, Id}]'.
-spec subs() -> [{pid(), binary()}].
subs() ->
    pairs(?SUBS).

%% @doc The ids Pid subscribes to.
-spec subs_of(pid()) -> [binary()].
subs_of(Pid) ->
    pairs_of(?SUBS, Pid).

%% @doc Removes every subscription of Pid.
-spec del_subs_of(pid()) -> ok.
del_subs_of(Pid) ->
    true = ets:match_delete(?SUBS, {{Pid, '_'}}),
    ok.

%% @doc Pid subscribes to some key (one step of the table, not a listing).
-spec has_subs(pid()) -> boolean().
has_subs(Pid) ->
    case ets:select(?SUBS, [{{{Pid, '_'}}, [], [true]}], 1) of
        {[true], _} -> true;
        '$end_of_table' -> false
    end.

%% ===================================================================
%% Followers' registrations
%% ===================================================================

-spec add_followed(node(), binary(), pid()) -> ok.
add_followed(Follower, Id, Ref) ->
    true = ets:insert(?FOLLOWED, {{Follower, {Id, Ref}}}),
    ok.

-spec del_followed(node(), binary(), pid()) -> ok.
del_followed(Follower, Id, Ref) ->
    true = ets:delete(?FOLLOWED, {Follower, {Id, Ref}}),
    ok.

%% @doc The registrations Follower made through this node.
-spec followed(node()) -> [{binary(), pid()}].
followed(Follower) ->
    pairs_of(?FOLLOWED, Follower).

%% ===================================================================
%% Internals
%% ===================================================================

pairs(Tab) ->
    [P || {P} <- ets:tab2list(Tab)].

pairs_of(Tab, A) when is_atom(A) ->
    case atom_to_list(A) of
        %% In a match pattern '_' and '$N' would be wildcards: compare
        %% instead (a scan; no node is named so).
        [C | _] when C =:= $_; C =:= $$ ->
            ets:select(Tab, [{{{'$1', '$2'}}, [{'=:=', '$1', {const, A}}], ['$2']}]);
        _ ->
            ets:select(Tab, [{{{A, '$1'}}, [], ['$1']}])
    end;
pairs_of(Tab, A) ->
    ets:select(Tab, [{{{A, '$1'}}, [], ['$1']}]).
