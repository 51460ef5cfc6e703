%% @doc The options of actor_cnode and what they resolve to: checks and
%% defaults (from the application environment), the executable's path, the
%% C node's name and the I/O backend asked of it.
%%
%% Pure apart from reading the environment and code paths: the owner
%% process (actor_cnode) calls these before and while it starts its first
%% incarnation, and {@link actor_cnode:start/1} checks options with them
%% before it asks the supervisor.
-module(actor_cnode_opts).

-export([validate/1]).
-export([executable/1]).
-export([node_name/1]).
-export([io_request/1]).

-include("actor_pool_int.hrl").

defaults() ->
    Env = fun(Key, Default) -> application:get_env(actor_pool, Key, Default) end,
    #{name => undefined,
      io => io_default(),
      max_frame => Env(max_frame, 67108864),
      idle_timeout_ms => Env(idle_timeout_ms, 60000),
      handshake_timeout_ms => Env(handshake_timeout_ms, 5000),
      max_handshakes => Env(max_handshakes, 256),
      max_handshakes_per_source => Env(max_handshakes_per_source, 64),
      args => [],
      backoff => Env(cnode_backoff, #{min_ms => 100, max_ms => 5000}),
      stable_ms => Env(cnode_stable_ms, 10000),
      start_timeout_ms => Env(cnode_start_timeout_ms, 10000),
      register => undefined,
      notify => undefined,
      shm => false}.

%% The application key `io'; `io_backend', its old name, still counts
%% while `io' is auto, so an old sys.config keeps working.
io_default() ->
    case application:get_env(actor_pool, io, auto) of
        auto -> application:get_env(actor_pool, io_backend, auto);
        Io -> Io
    end.

%% The C node listens where this node's distribution does, unless told.
%% C nodes speak IPv4 only: an IPv6 distribution interface cannot be
%% followed, so it falls back as if unset (logged once for each value).
default_listen_ip() ->
    case application:get_env(kernel, inet_dist_use_interface) of
        {ok, {_, _, _, _} = Ip} ->
            Ip;
        {ok, Other} ->
            Ip = application:get_env(actor_pool, cnode_listen_ip, any),
            Key = {actor_cnode, listen_ip_fallback},
            case persistent_term:get(Key, undefined) of
                Other ->
                    ok;
                _ ->
                    persistent_term:put(Key, Other),
                    logger:warning("actor_cnode: kernel inet_dist_use_interface ~0p is not an "
                                  "IPv4 address, which C nodes need; they listen on ~0p (set "
                                  "listen_ip to choose)", [Other, Ip],
                                  #{listen_ip_fallback => Other})
            end,
            Ip;
        undefined ->
            application:get_env(actor_pool, cnode_listen_ip, any)
    end.

%% @doc Every key is checked, the defaults from the application environment
%% too; unknown keys are errors. Returns the options with every key present.
-spec validate(term()) -> {ok, map()} | {error, {badarg, {atom(), term()}}}.
validate(Opts) when is_map(Opts) ->
    case maps:is_key(exe, Opts) of
        false ->
            {error, {badarg, {exe, missing}}};
        true ->
            %% The caller's keys first, so that their errors are reported.
            Defaults = case maps:is_key(listen_ip, Opts) of
                           true -> maps:without(maps:keys(Opts), defaults());
                           false -> (maps:without(maps:keys(Opts), defaults()))#{
                                      listen_ip => default_listen_ip()}
                       end,
            validate_keys(maps:to_list(Opts) ++ maps:to_list(Defaults), #{})
    end;
validate(Opts) ->
    {error, {badarg, {options, Opts}}}.

validate_keys([], Valid) ->
    {ok, Valid};
validate_keys([{Key, Value} | Rest], Valid) ->
    case check(Key, Value) of
        {ok, Value1} -> validate_keys(Rest, Valid#{Key => Value1});
        error -> {error, {badarg, {Key, Value}}}
    end.

check(exe, Exe) when is_binary(Exe) ->
    check(exe, unicode:characters_to_list(Exe));
check(exe, [_ | _] = Exe) ->
    case io_lib:char_list(Exe) andalso not lists:member(0, Exe) of
        true -> {ok, Exe};
        false -> error
    end;
check(Key, undefined) when Key =:= name; Key =:= register; Key =:= notify ->
    {ok, undefined};
check(notify, Pid) when is_pid(Pid) ->
    {ok, Pid};
check(notify, Name) when is_atom(Name) ->
    {ok, Name};
check(name, Name) when is_atom(Name) ->
    check(name, atom_to_list(Name));
check(name, Name) when is_binary(Name) ->
    check(name, binary_to_list(Name));
check(name, [_ | _] = Name) ->
    case length(Name) =< 200 andalso lists:all(fun alive_char/1, Name) of
        true -> {ok, Name};
        false -> error
    end;
check(io, Io) when Io =:= auto; Io =:= uring; Io =:= epoll ->
    {ok, Io};
check(max_frame, N) when is_integer(N), N >= ?MIN_MAX_FRAME, N =< 16#FFFFFFFF ->
    {ok, N};
check(Key, N) when (Key =:= idle_timeout_ms orelse Key =:= start_timeout_ms),
                   is_integer(N), N > 0 ->
    {ok, N};
check(stable_ms, N) when is_integer(N), N >= 0 ->
    {ok, N};
check(handshake_timeout_ms, N) when is_integer(N), N > 0, N =< 3600000 ->
    {ok, N};
check(Key, N) when (Key =:= max_handshakes orelse Key =:= max_handshakes_per_source),
                   is_integer(N), N > 0, N =< 65536 ->
    {ok, N};
check(listen_ip, any) ->
    {ok, any};
check(listen_ip, {A, B, C, D} = Ip)
  when is_integer(A), A >= 0, A =< 255, is_integer(B), B >= 0, B =< 255,
       is_integer(C), C >= 0, C =< 255, is_integer(D), D >= 0, D =< 255 ->
    {ok, Ip};
check(args, Args) when is_list(Args) ->
    try [unicode:characters_to_binary(A) || A <- Args] of
        Bins ->
            case lists:all(fun is_binary/1, Bins) andalso length(Bins) =:= length(Args) of
                true -> {ok, Bins};
                false -> error
            end
    catch
        _:_ -> error
    end;
check(backoff, #{} = Backoff) ->
    Merged = maps:merge(#{min_ms => 100, max_ms => 5000}, Backoff),
    case Merged of
        #{min_ms := Min, max_ms := Max} when map_size(Merged) =:= 2,
                                             is_integer(Min), Min > 0,
                                             is_integer(Max), Max >= Min ->
            {ok, Merged};
        _ ->
            error
    end;
check(register, Name) when is_atom(Name) ->
    {ok, Name};
check(shm, Shm) when is_boolean(Shm) ->
    {ok, Shm};
check(_Key, _Value) ->
    error.

alive_char(C) ->
    (C >= $a andalso C =< $z) orelse (C >= $A andalso C =< $Z)
        orelse (C >= $0 andalso C =< $9) orelse C =:= $_ orelse C =:= $-.

%% @doc The executable's absolute path: as given, or under priv/.
-spec executable(string()) -> file:filename().
executable(Exe) ->
    case filename:pathtype(Exe) of
        absolute -> Exe;
        _ -> filename:join(actor_pool_priv:dir(), Exe)
    end.

%% @doc The C node's name, Alive_Suffix@Host unless given: Suffix is the
%% executable's name without "actor_" and "_node", so actor_echo_node under
%% app@h is app_echo@h.
-spec node_name(map()) -> node().
node_name(Opts) ->
    [Alive, Host] = string:split(atom_to_list(erlang:node()), "@"),
    Name = case maps:get(name, Opts) of
               undefined -> Alive ++ "_" ++ exe_suffix(maps:get(exe, Opts));
               Given -> Given
           end,
    list_to_atom(Name ++ "@" ++ Host).

exe_suffix(Exe) ->
    Base = filename:basename(Exe),
    NoPrefix = case string:prefix(Base, "actor_") of
                   nomatch -> Base;
                   Rest -> Rest
               end,
    Suffix = case lists:suffix("_node", NoPrefix) of
                 true -> lists:sublist(NoPrefix, length(NoPrefix) - 5);
                 false -> NoPrefix
             end,
    case [C || C <- Suffix, alive_char(C)] of
        [] -> "cnode";
        Clean -> Clean
    end.

%% @doc The I/O backend asked of the C node: an explicit uring or epoll
%% wins; auto defers to ACTOR_POOL_IO if set.
-spec io_request(actor_cnode:io()) -> string().
io_request(auto) ->
    case os:getenv("ACTOR_POOL_IO") of
        Io when Io =:= "uring"; Io =:= "epoll"; Io =:= "auto" -> Io;
        _ -> "auto"
    end;
io_request(Io) ->
    atom_to_list(Io).
