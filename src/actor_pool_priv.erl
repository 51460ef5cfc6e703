%% @private
%% @doc Where the application's own files are (`priv/': the C nodes, the
%% NIF libraries) and what a NIF module does when its library will not
%% load: one lookup and one fallback for every module that needs them.
-module(actor_pool_priv).

-export([dir/0]).
-export([nif_loaded/4]).

%% @doc The application's `priv/' directory. code:priv_dir/1 knows it when
%% the application is in a lib directory (a release, rebar3's `_build');
%% an escript or a bare `-pa' of the ebin directory falls back to `../priv'
%% beside this module's beam.
-spec dir() -> file:filename().
dir() ->
    case code:priv_dir(actor_pool) of
        Dir when is_list(Dir) ->
            case filelib:is_dir(Dir) of
                true -> Dir;
                false -> beam_dir()
            end;
        {error, _} ->
            beam_dir()
    end.

%% @doc What a NIF module's on_load does with erlang:load_nif/2's answer
%% (the call itself must be the module's own: it loads for its caller).
%% A library that will not load leaves the module loaded without it, its
%% functions raising `not_loaded', and says so once in the log: `Lost'
%% names what is disabled.
-spec nif_loaded(module(), file:filename(), ok | {error, {atom(), string()}}, string()) -> ok.
nif_loaded(_Module, _Path, ok, _Lost) ->
    ok;
nif_loaded(Module, Path, {error, {Reason, Text}}, Lost) ->
    logger:warning("~ts: cannot load ~ts: ~0p: ~ts; ~ts", [Module, Path, Reason, Text, Lost]),
    ok.

beam_dir() ->
    case code:which(?MODULE) of
        Beam when is_list(Beam) ->
            filename:join(filename:dirname(filename:dirname(Beam)), "priv");
        _ ->
            "priv"
    end.
