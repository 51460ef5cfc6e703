%% @doc The in-BEAM anchor of the pool benchmark: a plain Erlang round-robin
%% pool of N gen_server workers, each applying the same function to every
%% request (for json_validate: `ap_bench_json:validate/1', i.e. jiffy; for
%% echo: the identity, the in-VM gen_server pool of issue 13).
%%
%% There is no dispatcher process: a caller picks the next worker with an
%% `atomics' counter and calls (or casts to) it directly, so the pool itself
%% has no serial bottleneck and the reply comes straight from the worker (the
%% best a plain Erlang pool can do; a dispatcher gen_server would only be
%% slower). Each worker counts the casts it handled in its own state, so
%% `processed/1' counts tells at the receiver, as the bench does for the pool
%% node, without a shared counter the workers would contend on.
-module(ap_bench_erlpool).
-behaviour(gen_server).

-export([start/2, call/2, cast/2, processed/1, stop/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-opaque pool() :: {erlpool, atomics:atomics_ref(), tuple()}.
-export_type([pool/0]).

-type state() :: {fun((term()) -> term()), Casts :: non_neg_integer()}.

%% Starts N workers, linked to the caller, each running Fun(Request).
-spec start(pos_integer(), fun((term()) -> term())) -> pool().
start(N, Fun) when N >= 1 ->
    Ws = [begin {ok, W} = gen_server:start_link(?MODULE, Fun, []), W end
          || _ <- lists:seq(1, N)],
    {erlpool, atomics:new(1, [{signed, false}]), list_to_tuple(Ws)}.

-spec call(pool(), term()) -> term().
call(Pool, Req) ->
    gen_server:call(next(Pool), Req, 60000).

%% A tell: gen_server:cast to the next worker, which only counts it.
-spec cast(pool(), term()) -> ok.
cast(Pool, Msg) ->
    gen_server:cast(next(Pool), Msg).

%% The casts the workers have handled so far, summed over the workers.
-spec processed(pool()) -> non_neg_integer().
processed({erlpool, _, Ws}) ->
    lists:sum([gen_server:call(W, '$erlpool_processed', 60000) || W <- tuple_to_list(Ws)]).

-spec stop(pool()) -> ok.
stop({erlpool, _, Ws}) ->
    _ = [gen_server:stop(W) || W <- tuple_to_list(Ws)],
    ok.

next({erlpool, Next, Ws}) ->
    element(atomics:add_get(Next, 1, 1) rem tuple_size(Ws) + 1, Ws).

-spec init(fun((term()) -> term())) -> {ok, state()}.
init(Fun) -> {ok, {Fun, 0}}.

-spec handle_call(term(), gen_server:from(), state()) -> {reply, term(), state()}.
handle_call('$erlpool_processed', _From, {_, N} = S) -> {reply, N, S};
handle_call(Req, _From, {Fun, _} = S) -> {reply, Fun(Req), S}.

-spec handle_cast(term(), state()) -> {noreply, state()}.
handle_cast(_, {Fun, N}) -> {noreply, {Fun, N + 1}}.

-spec handle_info(term(), state()) -> {noreply, state()}.
handle_info(_, S) -> {noreply, S}.
