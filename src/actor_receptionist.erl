%% @doc The receptionist: a service registry. Processes register under a
%% service key; anyone can find, subscribe to, or look up the processes
%% serving a key.
%%
%% The registry lives in a C node (`priv/actor_receptionist_node', one per
%% BEAM node, started by the application); {@link actor_receptionist_server}
%% is its BEAM-side front. Every call below goes through that server, in the
%% order the caller made it, so a `register' followed by a `find' from one
%% process always sees the registration. {@link lookup/1} is the exception:
%% it reads the C node's shared-memory snapshot through a NIF, with no
%% message at all, and reflects every registration whose `registered' reply
%% has been sent.
%%
%% Rules (docs/receptionist.md has the guide):
%% <ul>
%% <li>The same id is the same key. Ids are binaries; atoms and strings are
%%     accepted and normalised to binaries.</li>
%% <li>Many refs per key, listed in registration order; registering the same
%%     ref twice changes nothing.</li>
%% <li>Registered refs are not watched: a registration lives until {@link
%%     deregister/2}, even when its process has died. Guard against stale
%%     refs (monitor the ref for high-value work). Opt in with {@link
%%     register/4} and `#{watch => true}': the registration then goes, on
%%     every member, when its process dies.</li>
%% <li>`{via, actor_receptionist, Name}' names a gen_server (or any OTP
%%     process): {@link register_name/2}, {@link whereis_name/1}, {@link
%%     send/2}, {@link unregister_name/1}. The name is the key {@link
%%     name_key/1} gives; its registration is watched.</li>
%% <li>Subscribers are watched: one that dies frees its slot. Subscriptions
%%     are bounded (`max_subscribers_per_key', `max_subscribers_total' in the
%%     application environment); a subscribe over a limit gets
%%     `{receptionist_subscribe_rejected, Key, Reason, Limit}' and never a
%%     listing.</li>
%% <li>A subscriber gets `{listing, Key, Refs}' at once and again whenever
%%     the set of refs for the key changes, never for a non-change; the
%%     listings for one subscriber arrive in order.</li>
%% </ul>
%% Messages are plain tuples; `include/actor_receptionist.hrl' has records
%% of the same shape.
-module(actor_receptionist).

-include("actor_pool_int.hrl").
-include("actor_receptionist_int.hrl").

%% register/2 is this module's, not the BIF.
-compile({no_auto_import, [register/2]}).

%% API.
-export([service_key/1]).
-export([register/2, register/3, register/4]).
-export([deregister/2, deregister/3]).
-export([find/2]).
-export([subscribe/2, subscribe/3]).
-export([status/0]).
-export([unsubscribe/2]).
-export([lookup/1]).
-export([receptionist_node/0]).
-export([stats/0]).

%% {via, actor_receptionist, Name}.
-export([register_name/2]).
-export([unregister_name/1]).
-export([whereis_name/1]).
-export([send/2]).
-export([name_key/1]).

%% Internal: also used by the server and tests.
-export([id/1]).

-export_type([key/0, id/0, listing/0, register_opts/0]).

-type key() :: {service_key, binary()}.
%% What {@link service_key/1} returns; the key in every message.

-type id() :: binary() | atom() | string().
%% A key's id as given by users: normalised to a binary of 1..1024 bytes.

-type listing() :: {listing, key(), [pid()]}.

-type register_opts() :: #{watch => boolean()}.
%% Options of {@link register/4}.

-define(CALL_TIMEOUT, 5000).
%% register_name/2 and unregister_name/1 wait for the C node to apply the
%% change: through a restart of it, if need be.
-define(NAME_TIMEOUT, 15000).

%% ===================================================================
%% API
%% ===================================================================

%% @doc The key for `Id'. Keys are values: two keys with the same id are the
%% same key. Raises `badarg' for an id that is not a binary, atom or string
%% of 1..1024 bytes (UTF-8).
-spec service_key(id() | key()) -> key().
service_key(Id) ->
    case id(Id) of
        {ok, Bin} -> {service_key, Bin};
        error -> erlang:error(badarg, [Id])
    end.

%% @doc Registers `Ref' under `Key' (a key or an id). Asynchronous: see
%% {@link register/3} for an acknowledgement. `{error, {badarg, _}}' for a
%% bad key or ref (nothing changes); `{error, noproc}' when the receptionist
%% is not running.
-spec register(key() | id(), pid()) -> ok | {error, {badarg, term()} | noproc}.
register(Key, Ref) ->
    reg(register, Key, Ref, undefined).

%% @doc As {@link register/2}; `ReplyTo' gets `{registered, Key, Ref}' once
%% the registration is recorded (and visible to {@link lookup/1}).
-spec register(key() | id(), pid(), pid()) -> ok | {error, {badarg, term()} | noproc}.
register(Key, Ref, ReplyTo) when is_pid(ReplyTo) ->
    reg(register, Key, Ref, ReplyTo);
register(_Key, _Ref, ReplyTo) ->
    {error, {badarg, {reply_to, ReplyTo}}}.

%% @doc As {@link register/3}, with options; `ReplyTo' may be `undefined'
%% (no acknowledgement). `#{}' is register/3. `#{watch => true}': this
%% node's receptionist monitors `Ref' and, when it dies, deregisters it,
%% which reaches every member as any deregistration does (a `Ref' on
%% another node is monitored across; when that node goes, its refs go
%% anyway). A registration is watched from the first register that asks
%% (`watch => false' does not undo it) until it is deregistered; the watch
%% outlives a restart of the receptionist's server and of its C node.
%% Other options: `{error, {badarg, {opts, Opts}}}'.
-spec register(key() | id(), pid(), pid() | undefined, register_opts()) ->
          ok | {error, {badarg, term()} | noproc}.
register(Key, Ref, ReplyTo, Opts) ->
    case watch_opt(Opts) of
        error -> {error, {badarg, {opts, Opts}}};
        _ when not (is_pid(ReplyTo) orelse ReplyTo =:= undefined) ->
            {error, {badarg, {reply_to, ReplyTo}}};
        {ok, false} -> reg(register, Key, Ref, ReplyTo);
        {ok, true} -> reg(register_watched, Key, Ref, ReplyTo)
    end.

watch_opt(Opts) when Opts =:= #{} -> {ok, false};
watch_opt(#{watch := Watch} = Opts) when map_size(Opts) =:= 1, is_boolean(Watch) -> {ok, Watch};
watch_opt(_) -> error.

%% @doc Removes the registration of `Ref' under `Key' (nothing happens if
%% there is none).
-spec deregister(key() | id(), pid()) -> ok | {error, {badarg, term()} | noproc}.
deregister(Key, Ref) ->
    reg(deregister, Key, Ref, undefined).

%% @doc As {@link deregister/2}; `ReplyTo' gets `{deregistered, Key, Ref}'.
-spec deregister(key() | id(), pid(), pid()) -> ok | {error, {badarg, term()} | noproc}.
deregister(Key, Ref, ReplyTo) when is_pid(ReplyTo) ->
    reg(deregister, Key, Ref, ReplyTo);
deregister(_Key, _Ref, ReplyTo) ->
    {error, {badarg, {reply_to, ReplyTo}}}.

%% @doc `ReplyTo' gets one `{listing, Key, Refs}': the current view.
-spec find(key() | id(), pid()) -> ok | {error, {badarg, term()} | noproc}.
find(Key, ReplyTo) ->
    cast_checked(Key, reply_to, ReplyTo, fun(Id) -> {find, Id, ReplyTo} end).

%% @doc `Subscriber' gets `{listing, Key, Refs}' now and whenever the refs
%% for `Key' change, until {@link unsubscribe/2} or its death; or, over a
%% limit, one `{receptionist_subscribe_rejected, Key, Reason, Limit}' and
%% nothing else. Subscribing twice is one subscription (and a fresh
%% listing).
-spec subscribe(key() | id(), pid()) -> ok | {error, {badarg, term()} | noproc}.
subscribe(Key, Subscriber) ->
    cast_checked(Key, subscriber, Subscriber, fun(Id) -> {subscribe, Id, Subscriber} end).

%% @doc As {@link subscribe/2}; with `#{complete => true}' the subscription
%% (and so its first listing) waits until this node's view of the cluster is
%% complete: the initial sync with every member it knows is done (see
%% {@link status/0}). A node that has just joined then never reports an
%% empty or partial listing that is only unsynced. `#{}' is subscribe/2.
-spec subscribe(key() | id(), pid(), #{complete => boolean()}) ->
          ok | {error, {badarg, term()} | noproc}.
subscribe(Key, Subscriber, #{complete := true} = Opts) when map_size(Opts) =:= 1 ->
    cast_checked(Key, subscriber, Subscriber,
                 fun(Id) -> {subscribe_when_complete, Id, Subscriber} end);
subscribe(Key, Subscriber, Opts) when Opts =:= #{}; Opts =:= #{complete => false} ->
    subscribe(Key, Subscriber);
subscribe(_Key, _Subscriber, Opts) ->
    {error, {badarg, {opts, Opts}}}.

%% @doc This node's view of the cluster: `complete' (the initial sync with
%% every member this node knows of is done: each visible node has sent its
%% state or turned out to run no receptionist), `members' (the nodes whose
%% receptionists this one exchanges with), `syncing' (those not synced
%% yet), `origins' (per node whose registrations are held here, its
%% incarnation and version), and this node's own `incarnation' and
%% `version' (one per change of its registrations).
-spec status() -> actor_receptionist_gossip:status() | {error, noproc | timeout}.
status() ->
    case whereis(?RCPT_SERVER) of
        undefined -> {error, noproc};
        _ ->
            try gen_server:call(?RCPT_SERVER, status, ?CALL_TIMEOUT)
            catch exit:{timeout, _} -> {error, timeout};
                  exit:_ -> {error, noproc}
            end
    end.

%% @doc Ends a subscription; no listing arrives after the ones already
%% sent.
-spec unsubscribe(key() | id(), pid()) -> ok | {error, {badarg, term()} | noproc}.
unsubscribe(Key, Subscriber) ->
    cast_checked(Key, subscriber, Subscriber, fun(Id) -> {unsubscribe, Id, Subscriber} end).

%% @doc The refs registered under `Key', read from the receptionist's
%% shared-memory snapshot by a NIF: no message, no copy of the registry.
%% Falls back to asking the receptionist when no snapshot is mapped (or it
%% is stale); `[]' when neither answers. Raises `badarg' for a bad key.
-spec lookup(key() | id()) -> [pid()].
lookup({service_key, Id}) when ?IS_ID(Id) ->
    fast_lookup(Id);
lookup(Key) ->
    case id(Key) of
        {ok, Id} -> fast_lookup(Id);
        error -> erlang:error(badarg, [Key])
    end.

%% @doc The receptionist C node of this node, `undefined' when the
%% application does not run one.
-spec receptionist_node() -> node() | undefined.
receptionist_node() ->
    case persistent_term:get(?RCPT_NODE_KEY, undefined) of
        {Self, Node} when Self =:= node() -> Node;
        _ -> undefined
    end.

%% @doc Counters of the receptionist C node (keys, refs, subscriptions,
%% listings sent, the snapshot's state and size) and of the BEAM side
%% (`local_registrations', `watched_registrations' of them,
%% `local_subscriptions', `status').
-spec stats() -> map() | {error, noproc | timeout}.
stats() ->
    case whereis(?RCPT_SERVER) of
        undefined -> {error, noproc};
        _ -> gen_server:call(?RCPT_SERVER, stats, ?CALL_TIMEOUT)
    end.

%% ===================================================================
%% {via, actor_receptionist, Name}: OTP's contract for a process registry
%% (gen_server, gen_statem, supervisor, Elixir's GenServer, ...)
%% ===================================================================

%% @doc The key that `{via, actor_receptionist, Name}' registers under. A
%% key or an id ({@link service_key/1}: a binary, atom or string) is that
%% key, so `{via, actor_receptionist, <<"billing">>}' is found under
%% `service_key(<<"billing">>)'; any other term is the key whose id is its
%% external term format (`term_to_binary(Name, [deterministic,
%% {minor_version, 2}])': the same on every node of one OTP release, and
%% never equal to a UTF-8 id). Raises `badarg' when that is over 1024
%% bytes.
-spec name_key(term()) -> key().
name_key(Name) ->
    case name_id(Name) of
        {ok, Id} -> {service_key, Id};
        error -> erlang:error(badarg, [Name])
    end.

%% @doc Registers `Pid' under `Name' (see {@link name_key/1}), watched, if
%% no ref is registered under its key as far as this node knows (this
%% node's registrations and the other members' it has learnt; a dead
%% process of this node does not count): `yes', and {@link whereis_name/1}
%% on this node sees it at once; `no' otherwise (`gen_server:start_link'
%% then returns `{error, {already_started, Holder}}').
%%
%% One member never gives a name twice: this node's receptionist answers
%% the calls one at a time. Two members can, to two calls made within the
%% time it takes a registration to reach the other (a message between the
%% two nodes; during a partition, until it heals): both answer `yes', and
%% the name has two holders until one of them stops (or
%% unregisters). {@link whereis_name/1} then picks the same one of them on
%% every member. For a lock on a name cluster-wide, use `global'.
-spec register_name(term(), pid()) -> yes | no.
register_name(Name, Pid) when is_pid(Pid) ->
    case name_id(Name) of
        {ok, Id} -> gen_server:call(?RCPT_SERVER, {register_name, Id, Pid}, ?NAME_TIMEOUT);
        error -> erlang:error(badarg, [Name, Pid])
    end;
register_name(Name, Pid) ->
    erlang:error(badarg, [Name, Pid]).

%% @doc Removes the registrations under `Name' that this node made through
%% {@link register_name/2} (or {@link register/4} with `watch'), and
%% returns once {@link whereis_name/1} here no longer sees them. Another
%% member's registrations under it stay (each member removes its own).
-spec unregister_name(term()) -> ok.
unregister_name(Name) ->
    case {name_id(Name), whereis(?RCPT_SERVER)} of
        {{ok, Id}, Server} when is_pid(Server) ->
            gen_server:call(Server, {unregister_name, Id}, ?NAME_TIMEOUT);
        _ ->
            ok
    end.

%% @doc The holder of `Name': of the refs {@link lookup/1} lists under its
%% key, less the processes of this node that are not alive, the least in
%% Erlang's term order (the same on every node), so every member whose
%% view is the same picks the same one; `undefined' when there is none.
%% Like `global', it can name a process of another node that has just
%% died: a call to it then fails with `noproc'.
-spec whereis_name(term()) -> pid() | undefined.
whereis_name(Name) ->
    case name_id(Name) of
        {ok, Id} ->
            %% A dead process here is never the holder (its DOWN may not
            %% have reached the receptionist yet), so that gen:start/6,
            %% which asks this first, starts the next one at once
            %% (register_name/2 does not count it either).
            case [R || R <- fast_lookup(Id), node(R) =/= node() orelse is_process_alive(R)] of
                [] -> undefined;
                Refs -> lists:min(Refs)
            end;
        error ->
            undefined
    end.

%% @doc Sends `Msg' to the holder of `Name' ({@link whereis_name/1}) and
%% returns its pid; exits with `{badarg, {Name, Msg}}' when there is none.
-spec send(term(), term()) -> pid().
send(Name, Msg) ->
    case whereis_name(Name) of
        undefined ->
            exit({badarg, {Name, Msg}});
        Pid ->
            Pid ! Msg,
            Pid
    end.

%% ===================================================================
%% Internals
%% ===================================================================

%% A via name's key id: the id itself, or the external term format.
name_id(Name) ->
    case id(Name) of
        {ok, _} = Ok ->
            Ok;
        error ->
            Bin = term_to_binary(Name, [deterministic, {minor_version, 2}]),
            case ?IS_ID(Bin) of
                true -> {ok, Bin};
                false -> error
            end
    end.

%% @private
%% @doc The binary id of a key or id; `error' if it is not one.
-spec id(term()) -> {ok, binary()} | error.
id({service_key, Id}) -> id(Id);
id(Id) when ?IS_ID(Id) -> {ok, Id};
id(Id) when is_atom(Id), Id =/= undefined -> id(atom_to_binary(Id, utf8));
id(Id) when is_list(Id) ->
    try unicode:characters_to_binary(Id) of
        Bin when is_binary(Bin) -> id(Bin);
        _ -> error
    catch
        error:_ -> error
    end;
id(_) -> error.

reg(Op, Key, Ref, ReplyTo) ->
    cast_checked(Key, ref, Ref, fun(Id) -> {Op, Id, Ref, ReplyTo} end).

%% Every request names a key and a pid: a bad key is reported first, then a
%% bad pid under its argument's name (`What'); a good pair is cast as the
%% message Msg(Id) builds.
cast_checked(Key, What, Pid, Msg) ->
    case {id(Key), is_pid(Pid)} of
        {{ok, Id}, true} -> cast(Msg(Id));
        {error, _} -> {error, {badarg, {key, Key}}};
        {_, false} -> {error, {badarg, {What, Pid}}}
    end.

cast(Msg) ->
    case whereis(?RCPT_SERVER) of
        undefined -> {error, noproc};
        Pid -> gen_server:cast(Pid, Msg)
    end.

fast_lookup(Id) ->
    try actor_nif:lookup(Id) of
        Refs when is_list(Refs) -> Refs;
        {error, _} -> slow_lookup(Id)
    catch
        error:_ -> slow_lookup(Id)
    end.

%% No snapshot: ask the C node itself (it answers from its registry).
slow_lookup(Id) ->
    case receptionist_node() of
        undefined ->
            [];
        Node ->
            try gen_server:call({?RCPT_PROC, Node}, {lookup, Id}, ?CALL_TIMEOUT) of
                Refs when is_list(Refs) -> Refs;
                _ -> []
            catch
                exit:_ -> []
            end
    end.
