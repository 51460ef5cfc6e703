%% @private
%% @doc What this node holds of the other members' registrations.
%%
%% Not a process: state that {@link actor_receptionist_server} keeps and
%% changes in its own process, as the gossip core's effects tell it to. Each
%% function returns the messages the C node must get for the change, in
%% order; the server queues them (`rregister', `rderegister', `retag',
%% `drop_origin': docs/receptionist.md, "Internals").
%%
%% Per other member (origin), a set table of the `{{Id, Ref}}' it has
%% registered, as far as we know; the server is its only writer and a
%% replay reads it. The C node tags each ref with one origin, so that a
%% member that leaves is dropped in one step (`drop_origin'); its table is
%% then handed to a short-lived process that deletes it (reap/1), so a large
%% member costs the server nothing when it leaves. The tables die with the
%% server: a new server is a new incarnation, and the members send their
%% registrations again.
%%
%% Shared refs: the same ref under the same key may be held by several
%% origins (this node, through its journal, and others). The C node holds it
%% once, tagged with one of them; the named set table
%% `actor_receptionist_shared' lists such `{{Id, Ref}}' pairs. When the
%% origin it is tagged with lets go while another still holds it, it is
%% re-tagged (`retag', no listing) instead of removed; before a member is
%% dropped, its shared refs are re-tagged to a remaining holder. A pair not
%% in the shared table has exactly one holder.
%%
%% Who holds a pair is asked at every registration (is it shared?), so it
%% is an index, not a look into every origin's table: the ordered_set
%% `actor_receptionist_holders' has `{{{Id, Ref}, Tab}}' for each origin
%% table Tab that holds the pair, found by that key prefix in O(log n)
%% however many origins there are. Its rows name the table, not the
%% origin, so that the reaper of a member's table deletes that table's rows
%% too (the index is public for it), while the server, which forgets the
%% table when the member leaves, skips them meanwhile; the same member
%% back (a new table) has rows of its own.
-module(actor_receptionist_remote).

%% The tables' names: this module alone uses them.
-define(SHARED, actor_receptionist_shared).
-define(HOLDERS, actor_receptionist_holders).

-export([new/0]).
-export([ops/3]).
-export([replace/3]).
-export([drop/2]).
-export([rows/2]).
-export([refs/2]).
-export([replay/1]).
-export([local_added/3]).
-export([let_go/3]).
-export([reap/1]).

-export_type([state/0, cmsg/0]).

-record(remote, {
    %% per origin, the set table of its {{Id, Ref}}
    tabs = #{} :: #{node() => ets:tid()},
    %% and back: the origin of each table held
    owners = #{} :: #{ets:tid() => node()},
    %% tables of members that left, deleted at the next reap/1
    reap = [] :: [ets:tid()]
}).

-opaque state() :: #remote{}.

-type cmsg() :: {rregister | rderegister, node(), binary(), pid()}
              | {retag, binary(), pid(), node() | undefined}
              | {drop_origin, node()}.
%% A message for the C node.

%% ===================================================================
%% API
%% ===================================================================

%% @doc No member's registrations yet; creates the shared table and the
%% holders' index, owned by the caller.
-spec new() -> state().
new() ->
    ?SHARED = ets:new(?SHARED, [named_table, set, protected]),
    ?HOLDERS = ets:new(?HOLDERS, [named_table, ordered_set, public]),
    #remote{}.

%% @doc A delta of Origin: `{reg | dereg, Id, Ref}' in order.
-spec ops(node(), [term()], state()) -> {state(), [cmsg()]}.
ops(Origin, Ops, R) ->
    done(lists:foldl(fun({reg, Id, Ref}, SA) when is_binary(Id), is_pid(Ref) ->
                             reg(Origin, Id, Ref, SA);
                        ({dereg, Id, Ref}, SA) when is_binary(Id), is_pid(Ref) ->
                             dereg(Origin, Id, Ref, SA);
                        (_, SA) ->
                             SA
                     end, {R, []}, Ops)).

%% @doc Origin's whole state: what changed since what we held.
-spec replace(node(), [term()], state()) -> {state(), [cmsg()]}.
replace(Origin, Regs0, R) ->
    Regs = [E || {Id, Ref} = E <- Regs0, is_binary(Id), is_pid(Ref)],
    Old = sets:from_list(rows(Origin, R), [{version, 2}]),
    New = sets:from_list(Regs, [{version, 2}]),
    SA = sets:fold(fun({Id, Ref}, SA0) -> dereg(Origin, Id, Ref, SA0) end, {R, []},
                   sets:subtract(Old, New)),
    done(lists:foldl(fun({Id, Ref}, SA1) -> reg(Origin, Id, Ref, SA1) end, SA,
                     [E || E <- Regs, not sets:is_element(E, Old)])).

%% @doc A member left: its shared refs move to a remaining holder, then the
%% C node drops the rest of its refs at once (O(its refs), in C). `[]' when
%% nothing of it is held.
-spec drop(node(), state()) -> {state(), [cmsg()]}.
drop(Origin, #remote{tabs = Tabs, owners = Owners, reap = Reap} = R0) ->
    case maps:take(Origin, Tabs) of
        error ->
            {R0, []};
        {Tab, Tabs1} ->
            R1 = R0#remote{tabs = Tabs1, owners = maps:remove(Tab, Owners)},
            %% Its shared pairs: from the smaller of the two tables.
            Shared = case ets:info(?SHARED, size) =< ets:info(Tab, size) of
                         true -> [P || {P} <- ets:tab2list(?SHARED), ets:member(Tab, P)];
                         false -> [P || {P} <- ets:tab2list(Tab), ets:member(?SHARED, P)]
                     end,
            Retags = [Retag || {Id, Ref} <- Shared, {keep, Retag} <- [let_go(Id, Ref, R1)]],
            %% Deleting a large table costs CPU the C node needs right now
            %% for the drop itself: it waits for the next reap/1 (the
            %% server's next gossip round).
            {R1#remote{reap = [Tab | Reap]}, Retags ++ [{drop_origin, Origin}]}
    end.

%% @doc What we hold of Origin.
-spec rows(node(), state()) -> [{binary(), pid()}].
rows(Origin, #remote{tabs = Tabs}) ->
    case maps:find(Origin, Tabs) of
        {ok, Tab} -> [E || {E} <- ets:tab2list(Tab)];
        error -> []
    end.

%% @doc The refs the other members hold under Id: a range of the holders'
%% index.
-spec refs(binary(), state()) -> [pid()].
refs(Id, #remote{owners = Owners}) ->
    lists:usort([Ref || {Ref, T} <- ets:select(?HOLDERS, [{{{{Id, '$1'}, '$2'}}, [],
                                                           [{{'$1', '$2'}}]}]),
                        maps:is_key(T, Owners)]).

%% @doc Everything we hold, for a new incarnation of the C node.
-spec replay(state()) -> [cmsg()].
replay(#remote{tabs = Tabs} = R) ->
    [{rregister, O, Id, Ref} || O <- maps:keys(Tabs), {Id, Ref} <- rows(O, R)].

%% @doc The journal took {Id, Ref}: if a member holds it too, it is shared.
-spec local_added(binary(), pid(), state()) -> ok.
local_added(Id, Ref, R) ->
    _ = remote_holders(Id, Ref, R) =/= [] andalso ets:insert(?SHARED, {{Id, Ref}}),
    ok.

%% @doc A holder of {Id, Ref} let go of it (it is out of its table, or out
%% of the journal, already): remove it from the C node, or keep it for a
%% remaining holder.
-spec let_go(binary(), pid(), state()) -> remove | {keep, cmsg()}.
let_go(Id, Ref, R) ->
    case ets:member(?SHARED, {Id, Ref}) of
        false ->
            remove;
        true ->
            case holders(Id, Ref, R) of
                [] ->
                    true = ets:delete(?SHARED, {Id, Ref}),
                    remove;
                [H | More] ->
                    _ = More =:= [] andalso ets:delete(?SHARED, {Id, Ref}),
                    {keep, {retag, Id, Ref, c_origin(H)}}
            end
    end.

%% @doc Tables of members that left go to a short-lived process that
%% deletes them, so that the server does not spend the time.
-spec reap(state()) -> state().
reap(#remote{reap = []} = R) ->
    R;
reap(#remote{reap = Tabs} = R) ->
    Reaper = spawn(fun() -> reaper(length(Tabs)) end),
    [true = ets:give_away(T, Reaper, reap) || T <- Tabs],
    R#remote{reap = []}.

reaper(0) ->
    ok;
reaper(N) ->
    receive
        {'ETS-TRANSFER', T, _, reap} ->
            %% Its rows of the holders' index first (gone with the server
            %% that made it, if that ended: nothing left to delete then).
            try
                ets:foldl(fun({P}, ok) -> true = ets:delete(?HOLDERS, {P, T}), ok end, ok, T)
            catch
                error:badarg -> ok
            end,
            ets:delete(T),
            reaper(N - 1)
    after 60000 ->
        ok
    end.

%% ===================================================================
%% Internals
%% ===================================================================

%% reg/4 and dereg/4 take and return {State, C node messages newest first}.
reg(Origin, Id, Ref, {#remote{tabs = Tabs, owners = Owners} = R0, Acc}) ->
    {Tab, R} = case maps:find(Origin, Tabs) of
                   {ok, T} -> {T, R0};
                   error ->
                       T = ets:new(actor_receptionist_remote, [set, protected]),
                       {T, R0#remote{tabs = Tabs#{Origin => T}, owners = Owners#{T => Origin}}}
               end,
    case ets:member(Tab, {Id, Ref}) of
        true ->
            {R, Acc};
        false ->
            Shared = actor_receptionist_journal:registered(Id, Ref)
                orelse remote_holders(Id, Ref, R) =/= [],
            true = ets:insert(Tab, {{Id, Ref}}),
            true = ets:insert(?HOLDERS, {{{Id, Ref}, Tab}}),
            case Shared of
                true -> true = ets:insert(?SHARED, {{Id, Ref}}), {R, Acc};
                false -> {R, [{rregister, Origin, Id, Ref} | Acc]}
            end
    end.

dereg(Origin, Id, Ref, {#remote{tabs = Tabs} = R, Acc}) ->
    case maps:find(Origin, Tabs) of
        {ok, Tab} ->
            case ets:member(Tab, {Id, Ref}) of
                true ->
                    true = ets:delete(Tab, {Id, Ref}),
                    true = ets:delete(?HOLDERS, {{Id, Ref}, Tab}),
                    case let_go(Id, Ref, R) of
                        remove -> {R, [{rderegister, Origin, Id, Ref} | Acc]};
                        {keep, Retag} -> {R, [Retag | Acc]}
                    end;
                false ->
                    {R, Acc}
            end;
        error ->
            {R, Acc}
    end.

done({R, Acc}) ->
    {R, lists:reverse(Acc)}.

%% Who holds {Id, Ref}: `local' (our journal) and the other members.
holders(Id, Ref, R) ->
    [local || actor_receptionist_journal:registered(Id, Ref)] ++ remote_holders(Id, Ref, R).

%% The origins whose tables hold it: a range of the index (rows of tables
%% being reaped are skipped).
remote_holders(Id, Ref, #remote{owners = Owners}) ->
    [O || T <- ets:select(?HOLDERS, [{{{{Id, Ref}, '$1'}}, [], ['$1']}]),
          {ok, O} <- [maps:find(T, Owners)]].

c_origin(local) -> undefined;
c_origin(Origin) -> Origin.
