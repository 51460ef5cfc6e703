%% @doc The process that owns a pool in a user's supervision tree: what
%% {@link actor_pool:start_link/3} starts and {@link actor_pool:child_spec/3}
%% describes.
%%
%% It asks {@link actor_pool_keeper} to start the pool (on this node's pool
%% node, owned by this process) before its start returns, traps exits, and
%% asks the keeper to stop the pool when it terminates: when its supervisor
%% shuts it down, or its parent (the process that started it) exits. The
%% keeper watches it too: if it dies without stopping the pool (`kill'),
%% the keeper stops the pool, also one whose start was still under way.
%% While it runs, the keeper starts the pool again after a restart of the
%% pool node; this process is not told and stays up. If the actor_pool
%% application stops, the pool is gone with its pool node and this process
%% stops with `{shutdown, {actor_pool_down, Why}}' so that its supervisor
%% decides. A process, not a pool: it holds no messages for the pool and is
%% never linked to a C node.
%%
%% Its start is `proc_lib:start_link/3' and, once the pool runs,
%% `gen_server:enter_loop/3': a pool that cannot start makes `start_link'
%% return `{error, Reason}' and the new process exit `normal', so a caller
%% that does not trap exits (a shell) is not taken down with it, and no
%% crash report is logged for what is an answer.
-module(actor_pool_owner).
-behaviour(gen_server).

-export([start_link/3]).
-export([init_it/4]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2, terminate/2]).

-type state() :: #{name := atom(), app := reference()}.

%% @private
%% @doc Starts the owner and, in it, the pool; see actor_pool:start_link/3.
-spec start_link(actor_pool:name(), actor_pool:handler(), actor_pool:opts()) ->
          {ok, pid()} | {error, term()}.
start_link(Name, Handler, Opts) ->
    proc_lib:start_link(?MODULE, init_it, [self(), Name, Handler, Opts]).

%% @private
-spec init_it(pid(), term(), term(), term()) -> no_return().
init_it(Parent, Name, Handler, Opts) ->
    %% Before the start: a parent that exits meanwhile is seen after it,
    %% and the pool stopped (terminate/2).
    process_flag(trap_exit, true),
    %% The application's top supervisor: when it goes, so did the pool
    %% node and the keeper (a crash of the keeper alone loses nothing).
    App = erlang:monitor(process, actor_pool_sup),
    case actor_pool_keeper:start_owned(Name, Handler, Opts) of
        {ok, _Pool} ->
            proc_lib:init_ack(Parent, {ok, self()}),
            gen_server:enter_loop(?MODULE, [], #{name => Name, app => App});
        {error, _} = Error ->
            %% The keeper forgot this process with the failed start.
            proc_lib:init_ack(Parent, Error),
            exit(normal)
    end.

%% @private
%% @doc Not called: the process enters the gen_server loop from init_it/4,
%% once its pool runs. Here for the behaviour.
-spec init(state()) -> {ok, state()}.
init(State) ->
    {ok, State}.

%% @private
-spec handle_call(term(), gen_server:from(), state()) -> {reply, {error, unknown_call}, state()}.
handle_call(_Request, _From, State) ->
    {reply, {error, unknown_call}, State}.

%% @private
-spec handle_cast(term(), state()) -> {noreply, state()}.
handle_cast(_Msg, State) ->
    {noreply, State}.

%% @private
%% The parent's exit is the gen_server's own business (terminate/2 with
%% its reason); another linked process that fails takes this one along, as
%% it would without trapping exits.
-spec handle_info(term(), state()) -> {noreply, state()} | {stop, term(), state()}.
handle_info({'DOWN', App, process, _, Why}, #{app := App, name := Name} = State) ->
    logger:warning("actor_pool: pool ~p is gone: the actor_pool application stopped (~0p)", [Name, Why]),
    {stop, {shutdown, {actor_pool_down, Why}}, State};
handle_info({'EXIT', _From, normal}, State) ->
    {noreply, State};
handle_info({'EXIT', _From, Reason}, State) ->
    {stop, Reason, State};
handle_info(_Msg, State) ->
    {noreply, State}.

%% @private
-spec terminate(term(), state()) -> ok.
terminate(_Reason, #{name := Name}) ->
    actor_pool_keeper:stop_owned(Name).
