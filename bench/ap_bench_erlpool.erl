%% @doc The in-BEAM anchor of the pool benchmark: a plain Erlang round-robin
%% pool of N gen_server workers, each applying the same function to every
%% request (for json_validate: `ap_bench_json:validate/1', i.e. jiffy).
%%
%% There is no dispatcher process: a caller picks the next worker with an
%% `atomics' counter and calls it directly, so the pool itself has no serial
%% bottleneck and the reply comes straight from the worker (the best a plain
%% Erlang pool can do; a dispatcher gen_server would only be slower).
-module(ap_bench_erlpool).
-behaviour(gen_server).

-export([start/2, call/2, stop/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-opaque pool() :: {erlpool, atomics:atomics_ref(), tuple()}.
-export_type([pool/0]).

%% Starts N workers, linked to the caller, each running Fun(Request).
-spec start(pos_integer(), fun((term()) -> term())) -> pool().
start(N, Fun) when N >= 1 ->
    Ws = [begin {ok, W} = gen_server:start_link(?MODULE, Fun, []), W end
          || _ <- lists:seq(1, N)],
    {erlpool, atomics:new(1, [{signed, false}]), list_to_tuple(Ws)}.

-spec call(pool(), term()) -> term().
call({erlpool, Next, Ws}, Req) ->
    I = atomics:add_get(Next, 1, 1) rem tuple_size(Ws),
    gen_server:call(element(I + 1, Ws), Req, 60000).

-spec stop(pool()) -> ok.
stop({erlpool, _, Ws}) ->
    _ = [gen_server:stop(W) || W <- tuple_to_list(Ws)],
    ok.

-spec init(fun((term()) -> term())) -> {ok, fun((term()) -> term())}.
init(Fun) -> {ok, Fun}.

-spec handle_call(term(), gen_server:from(), fun((term()) -> term())) ->
          {reply, term(), fun((term()) -> term())}.
handle_call(Req, _From, Fun) -> {reply, Fun(Req), Fun}.

-spec handle_cast(term(), fun((term()) -> term())) -> {noreply, fun((term()) -> term())}.
handle_cast(_, Fun) -> {noreply, Fun}.

-spec handle_info(term(), fun((term()) -> term())) -> {noreply, fun((term()) -> term())}.
handle_info(_, Fun) -> {noreply, Fun}.
