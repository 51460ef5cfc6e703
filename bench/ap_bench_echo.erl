%% @doc The anchor of the runtime benchmark: the echo service of
%% `actor_echo_node', written as a plain gen_server on a BEAM peer node, so
%% both rows of the table measure the same work.
-module(ap_bench_echo).
-behaviour(gen_server).

-export([start/0]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-spec start() -> {ok, pid()}.
start() ->
    {ok, Pid} = gen_server:start({local, echo}, ?MODULE, [], []),
    {ok, Pid}.

-spec init([]) -> {ok, non_neg_integer()}.
init([]) -> {ok, 0}.

-spec handle_call(term(), gen_server:from(), non_neg_integer()) -> {reply, term(), non_neg_integer()}.
handle_call(pid, _From, N) -> {reply, self(), N};
handle_call(stats, _From, N) ->
    {Runtime, _} = erlang:statistics(runtime),
    {reply, #{tells => N, cpu_us => Runtime * 1000}, N};
handle_call(Req, _From, N) -> {reply, Req, N}.

-spec handle_cast(term(), non_neg_integer()) -> {noreply, non_neg_integer()}.
handle_cast(_, N) -> {noreply, N}.

-spec handle_info(term(), non_neg_integer()) -> {noreply, non_neg_integer()}.
handle_info({batch, L}, N) -> {noreply, N + length(L)};
handle_info(_, N) -> {noreply, N + 1}.
