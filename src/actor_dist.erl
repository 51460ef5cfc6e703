%% @doc Makes sure this BEAM is a distributed node.
%%
%% C nodes reach the BEAM over distributed Erlang, so the application needs a
%% node name. A node started with `-sname'/`-name' is left alone. Otherwise
%% epmd is started if it does not answer (`erl -sname' would have started it,
%% a plain `erl' does not) and `net_kernel' is started with short names and a
%% generated name `actor_pool_<random>@<host>', which is logged.
-module(actor_dist).

%% API.
-export([ensure_distributed/0]).

%% How long epmd may take to answer after `epmd -daemon'.
-define(EPMD_WAIT_MS, 5000).
%% Generated names are random; a clash with a name in epmd is retried.
-define(NAME_ATTEMPTS, 3).

%% @doc Makes sure this node is distributed.
%%
%% Returns `ok' at once if it is. If it is not, starts epmd when needed and
%% then distribution with short names and a generated name. Returns
%% `{error, Reason}' when epmd cannot be started or `net_kernel' fails.
-spec ensure_distributed() -> ok | {error, term()}.
ensure_distributed() ->
    case node() of
        nonode@nohost -> start_distribution();
        _ -> ok
    end.

start_distribution() ->
    case ensure_epmd() of
        ok -> start_net_kernel(?NAME_ATTEMPTS, undefined);
        {error, _} = Error -> Error
    end.

start_net_kernel(0, LastError) ->
    {error, LastError};
start_net_kernel(Attempts, _LastError) ->
    Name = generated_name(),
    case net_kernel:start([Name, shortnames]) of
        {ok, _} ->
            logger:notice("actor_pool: this node was not distributed; "
                          "started distribution as ~ts", [node()]),
            ok;
        {error, {already_started, _}} ->
            ok;
        {error, Reason} ->
            start_net_kernel(Attempts - 1, Reason)
    end.

generated_name() ->
    Unique = erlang:phash2({os:getpid(), erlang:monotonic_time(),
                            erlang:unique_integer(), rand:uniform(1 bsl 30)}),
    list_to_atom("actor_pool_" ++ string:lowercase(integer_to_list(Unique, 36))).

%% epmd

ensure_epmd() ->
    case epmd_answers() of
        true -> ok;
        false ->
            case epmd_executable() of
                false ->
                    {error, epmd_not_found};
                Epmd ->
                    _ = os:cmd(quote(Epmd) ++ " -daemon"),
                    wait_epmd(erlang:monotonic_time(millisecond) + ?EPMD_WAIT_MS)
            end
    end.

wait_epmd(Deadline) ->
    case epmd_answers() of
        true -> ok;
        false ->
            case erlang:monotonic_time(millisecond) >= Deadline of
                true -> {error, epmd_not_answering};
                false ->
                    %% Polling epmd: nothing to wait on but its port opening.
                    receive after 50 -> wait_epmd(Deadline) end
            end
    end.

epmd_answers() ->
    case erl_epmd:names() of
        {ok, _} -> true;
        {error, _} -> false
    end.

epmd_executable() ->
    Bundled = filename:join([code:root_dir(),
                             "erts-" ++ erlang:system_info(version),
                             "bin", "epmd"]),
    case filelib:is_regular(Bundled) of
        true -> Bundled;
        false -> os:find_executable("epmd")
    end.

quote(Path) ->
    "'" ++ lists:flatten(string:replace(Path, "'", "'\\''", all)) ++ "'".
