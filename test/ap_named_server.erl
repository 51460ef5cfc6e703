%% A gen_server to name through `{via, actor_receptionist, Name}' in the
%% receptionist's suites (on the test node and on peers), and a supervisor
%% of one such child.
%%
%% init(ok): a server that answers `whoami' with `{self(), node()}' and, on
%% a cast `{tell, To}', sends `{told, self()}' to To. init({stop, Reason}):
%% one whose init fails. init({sup, Name}): a supervisor of one permanent
%% server named `{via, actor_receptionist, Name}'.
-module(ap_named_server).

-export([init/1, handle_call/3, handle_cast/2]).

init(ok) ->
    {ok, #{}};
init({stop, Reason}) ->
    {stop, Reason};
init({sup, Name}) ->
    Child = #{id => named,
              start => {gen_server, start_link, [{via, actor_receptionist, Name}, ?MODULE, ok, []]}},
    {ok, {#{strategy => one_for_one, intensity => 5, period => 10}, [Child]}}.

handle_call(whoami, _From, State) ->
    {reply, {self(), node()}, State}.

handle_cast({tell, To}, State) ->
    To ! {told, self()},
    {noreply, State}.
