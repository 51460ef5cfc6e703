%% @doc The checks actor_pool makes before anything is sent: the arguments
%% of a pool's start (name, handler, options, with the defaults filled in)
%% and the terms that can reach a C node at all (a plugin's `Config', a
%% message: {@link sendable/1}).
%%
%% Everything is checked here, before the pool node is asked, so that a bad
%% argument gets one clear `{error, {badarg, {Key, Value}}}' whatever pool
%% node it was meant for. The pool node checks the same options again (any
%% peer can reach it); the numeric limits are the pool node's
%% (c_src/pool/pool_limits.h, seen here through actor_pool_int.hrl). A
%% plugin's file is the pool node's to open, on its own host: whether it is
%% there and loads is its answer (`{plugin_load_failed, Path, Why}'), the
%% same for a pool node on this host as elsewhere.
%% Pure apart from actor_receptionist:id/1: it calls no other module of the
%% pool side.
-module(actor_pool_opts).

-include("actor_pool_int.hrl").

-export([validate/4]).
-export([sendable/1]).
-export([host/1]).

%% Container nesting of a message: a C node accepts 1024 levels
%% (AP_TERM_MAX_DEPTH in c_src/cnode/dist/ap_term.h), and a batch wraps a message
%% in three more ({'$ap_batch', [{ask, ...}]}).
-define(MAX_DEPTH, 1000).

%% handler_timeout_ms of a process-mode pool unless given: what a stuck
%% worker process costs at most (docs/stateless-workers.md, "Stalls").
-define(PROCESS_TIMEOUT_MS, 5000).

%% @doc The arguments of actor_pool:start_pool/3 checked, and the defaults
%% filled in: `{ok, PoolNode, Handler, Options}' with the handler's plugin
%% path made absolute, or `{error, noproc}' (no pool node given, and
%% `DefaultNode' is `undefined') or `{error, {badarg, {What, Value}}}'.
%% `Options' still holds the BEAM-side keys (`service_key', `fast_path'),
%% for the caller to take out.
-spec validate(term(), term(), term(), node() | undefined) ->
          {ok, node(), actor_pool:handler(), map()} | {error, term()}.
validate(Name, _Handler, _Opts, _DefaultNode) when not is_atom(Name) ->
    {error, {badarg, {name, Name}}};
validate(_Name, _Handler, Opts, _DefaultNode) when not is_map(Opts) ->
    {error, {badarg, {opts, Opts}}};
validate(_Name, Handler, Opts, DefaultNode) ->
    case options(maps:to_list(Opts), defaults()) of
        {ok, Full0} ->
            {PoolNode, Full1} = case maps:take(node, Full0) of
                                    {N, Rest} -> {N, Rest};
                                    error -> {DefaultNode, Full0}
                                end,
            case PoolNode of
                undefined ->
                    {error, noproc};
                _ ->
                    case handler(Handler) of
                        {ok, Handler1} ->
                            case isolation(Handler1, Full1) of
                                {ok, Full} -> {ok, PoolNode, Handler1, Full};
                                {error, _} = Error -> Error
                            end;
                        error ->
                            {error, {badarg, {handler, Handler}}}
                    end
            end;
        {error, _} = Error ->
            Error
    end.

%% The isolation mode filled in (process for a plugin, thread for a
%% built-in: those cannot crash, and a thread costs less), and the handler
%% deadline that goes with it: a worker process stuck on one message is
%% killed after ?PROCESS_TIMEOUT_MS, a thread cannot be (c_src/pool/pool.h,
%% AP_POOL_DEFAULT_PROCESS_TIMEOUT_MS, the pool node's own default); a
%% memory limit needs a process to set it on.
isolation(Handler, Opts) ->
    Default = case Handler of
                  {plugin, _} -> process;
                  {plugin, _, _} -> process;
                  _ -> thread
              end,
    Full0 = maps:merge(#{isolation => Default}, Opts),
    Full = case Full0 of
               #{handler_timeout_ms := _} -> Full0;
               #{isolation := process} -> Full0#{handler_timeout_ms => ?PROCESS_TIMEOUT_MS};
               _ -> Full0#{handler_timeout_ms => infinity}
           end,
    case Full of
        #{isolation := thread, max_memory_mb := Mb} when Mb =/= infinity ->
            {error, {badarg, {max_memory_mb, Mb}}};
        #{isolation := thread, sandbox := Sb} ->
            %% A thread runs inside the pool node: nothing to sandbox.
            {error, {badarg, {sandbox, Sb}}};
        #{isolation := process, sandbox := _} ->
            {ok, Full};
        #{isolation := process} ->
            {ok, Full#{sandbox => sandbox_defaults()}};
        _ ->
            {ok, Full}
    end.

%% What a worker process may touch by default: its plugin, the system's
%% libraries, its own /proc entry; no network, no processes of its own
%% (c_src/pool/sandbox.h).
sandbox_defaults() ->
    #{read => [], write => [], network => false, fork => false}.

%% stall_ms: c_src/pool/pool.h, AP_POOL_DEFAULT_STALL_MS (the pool node's
%% own default).
defaults() ->
    #{workers => 0,
      routing => round_robin,
      mailbox_limit => 10000,
      backoff => #{min_ms => 50, max_ms => 5000, jitter => 0.2},
      stable_ms => 10000,
      stall_ms => 1000,
      max_memory_mb => infinity,
      max_reply_atoms => 1024}.

options([], Acc) ->
    {ok, Acc};
options([{Key, Value} | Rest], Acc) ->
    case option(Key, Value) of
        {ok, Valid} -> options(Rest, Acc#{Key => Valid});
        error -> {error, {badarg, {Key, Value}}}
    end.

option(workers, N) when is_integer(N), N >= 1, N =< ?AP_POOL_MAX_WORKERS ->
    {ok, N};
option(routing, R) when R =:= round_robin; R =:= smallest_mailbox; R =:= random ->
    {ok, R};
option(mailbox_limit, N) when is_integer(N), N >= 1, N =< ?AP_POOL_MAX_MAILBOX ->
    {ok, N};
option(stable_ms, N) when is_integer(N), N >= 0, N =< ?AP_POOL_MAX_STABLE_MS ->
    {ok, N};
option(isolation, I) when I =:= thread; I =:= process ->
    {ok, I};
option(handler_timeout_ms, infinity) ->
    {ok, infinity};
option(handler_timeout_ms, N) when is_integer(N), N >= 1, N =< ?AP_POOL_MAX_HANDLER_TIMEOUT_MS ->
    {ok, N};
option(stall_ms, infinity) ->
    {ok, infinity};
option(stall_ms, N) when is_integer(N), N >= 1, N =< ?AP_POOL_MAX_STALL_MS ->
    {ok, N};
option(max_memory_mb, infinity) ->
    {ok, infinity};
option(max_memory_mb, N) when is_integer(N), N >= 1, N =< ?AP_POOL_MAX_MEMORY_MB ->
    {ok, N};
%% No infinity: the atoms a handler's replies make in this BEAM are never
%% freed, and a full atom table aborts it.
option(max_reply_atoms, N) when is_integer(N), N >= 1, N =< ?AP_POOL_MAX_REPLY_ATOMS ->
    {ok, N};
option(backoff, #{} = B) ->
    Merged = maps:merge(#{min_ms => 50, max_ms => 5000, jitter => 0.2}, B),
    case Merged of
        #{min_ms := Min, max_ms := Max, jitter := J}
          when map_size(Merged) =:= 3,
               is_integer(Min), Min >= 1,
               is_integer(Max), Max >= Min, Max =< ?AP_POOL_MAX_BACKOFF_MS,
               is_number(J), J >= 0, J =< 1 ->
            {ok, Merged#{jitter := float(J)}};
        _ ->
            error
    end;
option(service_key, Key) ->
    case actor_receptionist:id(Key) of
        {ok, Id} -> {ok, Id};
        error -> error
    end;
option(sandbox, off) ->
    {ok, off};
option(sandbox, #{} = Sb) ->
    sandbox(maps:to_list(Sb), sandbox_defaults(), {0, 0});
option(fast_path, B) when is_boolean(B) ->
    {ok, B};
option(node, Node) when is_atom(Node), Node =/= nonode@nohost ->
    case lists:member($@, atom_to_list(Node)) of
        true -> {ok, Node};
        false -> error
    end;
option(_Key, _Value) ->
    error.

%% The sandbox's keys: read and write (absolute paths, at most
%% ?AP_POOL_MAX_SANDBOX_PATHS of ?AP_POOL_MAX_SANDBOX_BYTES with a NUL
%% each, in all), network and fork (booleans), uid and gid (what a root
%% pool node's workers run as, never 0).
sandbox([], Acc, {N, Bytes}) when N =< ?AP_POOL_MAX_SANDBOX_PATHS, Bytes =< ?AP_POOL_MAX_SANDBOX_BYTES ->
    {ok, Acc};
sandbox([{K, L} | Rest], Acc, {N, Bytes}) when K =:= read; K =:= write ->
    case sandbox_paths(L, []) of
        {ok, Abs} ->
            Sum = lists:sum([byte_size(B) + 1 || B <- Abs]),
            sandbox(Rest, Acc#{K := Abs}, {N + length(Abs), Bytes + Sum});
        error ->
            error
    end;
sandbox([{K, B} | Rest], Acc, Paths) when (K =:= network orelse K =:= fork), is_boolean(B) ->
    sandbox(Rest, Acc#{K := B}, Paths);
sandbox([{K, Id} | Rest], Acc, Paths)
  when (K =:= uid orelse K =:= gid), is_integer(Id), Id >= 1, Id =< 16#fffffffe ->
    sandbox(Rest, Acc#{K => Id}, Paths);
sandbox(_, _Acc, _Paths) ->
    error.

sandbox_paths([], Acc) ->
    {ok, lists:reverse(Acc)};
sandbox_paths([P | Rest], Acc) when is_list(P); is_binary(P) ->
    try unicode:characters_to_binary(P) of
        <<"/", _/binary>> = B when byte_size(B) =< ?AP_POOL_MAX_PATH ->
            case binary:match(B, <<0>>) of
                nomatch -> sandbox_paths(Rest, [B | Acc]);
                _ -> error
            end;
        _ ->
            error
    catch
        error:_ -> error
    end;
sandbox_paths(_, _Acc) ->
    error.

handler(echo) ->
    {ok, echo};
handler(json_validate) ->
    {ok, json_validate};
handler({plugin, Path}) ->
    case plugin_path(Path) of
        {ok, Abs} -> {ok, {plugin, Abs}};
        error -> error
    end;
handler({plugin, Path, Config}) ->
    case {plugin_path(Path), sendable(Config)} of
        {{ok, Abs}, Size} when is_integer(Size) -> {ok, {plugin, Abs, Config}};
        _ -> error
    end;
handler(_) ->
    error.

%% An absolute binary path: a relative one is taken from this BEAM's
%% working directory (the pool node's may differ, and may be on another
%% host).
plugin_path(Path) when is_list(Path); is_binary(Path) ->
    try unicode:characters_to_binary(Path) of
        Bin when is_binary(Bin), byte_size(Bin) > 0 ->
            Abs = filename:absname(Bin),
            case byte_size(Abs) =< ?AP_POOL_MAX_PATH andalso binary:match(Abs, <<0>>) =:= nomatch of
                true -> {ok, Abs};
                false -> error
            end;
        _ ->
            error
    catch
        error:_ -> error
    end;
plugin_path(_) ->
    error.

%% @doc The host part of a node name (`""' for none).
-spec host(node()) -> string().
host(Node) ->
    case string:split(atom_to_list(Node), "@") of
        [_, Host] -> Host;
        _ -> ""
    end.

%% @doc An upper bound of T's external size, or false when T holds a closure or
%% nests deeper than a C node accepts. A C node takes well-formed funs, but
%% no handler can run a closure, so one is refused here with a clear error;
%% containers nested deeper than the C node accepts (see ?MAX_DEPTH) would
%% close the whole connection, failing every ask in flight to that node.
%% The bound comes with the walk that these checks make anyway; a binary,
%% the usual message, costs one test and its byte_size.
-spec sendable(term()) -> non_neg_integer() | false.
sendable(T) -> sendable(T, 0, 0).

%% D: containers open above T; A: the bytes counted so far.
sendable(T, _D, A) when is_binary(T) -> A + byte_size(T) + 6;
sendable(T, _D, A) when is_integer(T), T >= -16#80000000, T =< 16#7FFFFFFF -> A + 5;
sendable(T, _D, A) when is_float(T) -> A + 9;
%% An atom: at most 255 characters of up to 4 bytes, and a 3-byte header
%% (a bound, not its size: no lookup of its text).
sendable(T, _D, A) when is_atom(T) -> A + 1023;
sendable(T, _D, A) when is_integer(T) -> A + erlang:external_size(T);
sendable([], _D, A) -> A + 1;
sendable([_ | _] = L, D, A) when D < ?MAX_DEPTH -> sendable_list(L, D + 1, A + 5);
sendable(T, D, A) when is_tuple(T), D < ?MAX_DEPTH ->
    sendable_tuple(T, tuple_size(T), D + 1, A + 5);
sendable(T, D, A) when is_map(T), D < ?MAX_DEPTH ->
    sendable_map(maps:next(maps:iterator(T)), D + 1, A + 5);
sendable(F, D, A) when is_function(F), D < ?MAX_DEPTH ->
    case erlang:fun_info(F, type) of
        {type, external} -> A + erlang:external_size(F);
        _ -> false
    end;
sendable(T, _D, A) when is_pid(T); is_port(T); is_reference(T) -> A + erlang:external_size(T);
sendable(T, _D, A) when is_bitstring(T) -> A + byte_size(T) + 7;
sendable(_T, _D, _A) -> false.

sendable_list([H | T], D, A) ->
    case sendable(H, D, A) of
        false -> false;
        A1 -> sendable_list(T, D, A1)
    end;
sendable_list([], _D, A) -> A + 1;
sendable_list(Tail, D, A) -> sendable(Tail, D, A).

sendable_tuple(_T, 0, _D, A) -> A;
sendable_tuple(T, I, D, A) ->
    case sendable(element(I, T), D, A) of
        false -> false;
        A1 -> sendable_tuple(T, I - 1, D, A1)
    end.

sendable_map(none, _D, A) -> A;
sendable_map({K, V, Next}, D, A) ->
    case sendable(K, D, A) of
        false ->
            false;
        A1 ->
            case sendable(V, D, A1) of
                false -> false;
                A2 -> sendable_map(maps:next(Next), D, A2)
            end
    end.
