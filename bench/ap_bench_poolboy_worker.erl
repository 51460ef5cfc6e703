%% @doc The poolboy anchor's worker (Debian `erlang-poolboy'): validates a
%% JSON document with jiffy, the same work as `ap_bench_erlpool' and the
%% `json_validate' pool.
-module(ap_bench_poolboy_worker).
-behaviour(gen_server).
-behaviour(poolboy_worker).

-export([start_link/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-spec start_link(term()) -> {ok, pid()}.
start_link(Args) -> gen_server:start_link(?MODULE, Args, []).

-spec init(term()) -> {ok, []}.
init(_) -> {ok, []}.

-spec handle_call(term(), gen_server:from(), []) -> {reply, term(), []}.
handle_call({validate, Doc}, _From, S) -> {reply, ap_bench_json:validate(Doc), S};
handle_call(Req, _From, S) -> {reply, {error, {bad_request, Req}}, S}.

-spec handle_cast(term(), []) -> {noreply, []}.
handle_cast(_, S) -> {noreply, S}.

-spec handle_info(term(), []) -> {noreply, []}.
handle_info(_, S) -> {noreply, S}.
