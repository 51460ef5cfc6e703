%% @doc A deliverer of answers that come back through the same-host rings
%% ({@link actor_dp}): one per scheduler, started by {@link actor_pool_sup}.
%%
%% Why: an answer sent by the NIF's reply thread, a thread the BEAM does
%% not manage, costs the VM more than the same send from a scheduler: a
%% lock in the allocator of such threads and, per answer, wake-ups of the
%% BEAM's aux thread (measured at 11-16% of a CPU under 64 callers, with
%% the reply thread itself at about 45%). So the reply thread hands each
%% reply ring with answers to a deliverer (one message per batch), and the
%% deliverer sends them from its scheduler ({@link actor_dp:drain/2}).
%% Several of them, so that the answers of one pool node's rings go out on
%% more than one scheduler at once. docs/journal/same-host-transport.md has the
%% measurements.
%%
%% A deliverer runs at priority `high': its work is short (at most 512
%% answers per message) and each answer it holds back keeps a caller
%% waiting. If one dies, the reply thread notices at its next send (or,
%% for a hand-over already sent, within 50 ms) and delivers that ring's
%% answers itself until the supervisor's restart registers a new one.
-module(actor_dp_deliverer).
-behaviour(gen_server).

-export([start_link/2, count/0]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

%% @doc Starts deliverer `Index' (0-based) of `Count'.
-spec start_link(non_neg_integer(), pos_integer()) -> {ok, pid()}.
start_link(Index, Count) ->
    gen_server:start_link(?MODULE, {Index, Count}, []).

%% @doc How many deliverers the application starts: one per scheduler
%% online, at most 64.
-spec count() -> pos_integer().
count() ->
    max(1, min(64, erlang:system_info(schedulers_online))).

%% actor_dp:loaded/0 is replaced by the NIF when it loads; its Erlang body
%% says `false', which is all dialyzer sees of it.
-dialyzer({nowarn_function, [init/1]}).
%% @private
-spec init({non_neg_integer(), pos_integer()}) -> {ok, {non_neg_integer(), pos_integer()}}.
init({Index, Count}) ->
    process_flag(priority, high),
    %% Without the NIF library there are no rings to deliver from: the
    %% process idles (actor_pool uses distribution then).
    _ = case actor_dp:loaded() of
            true -> actor_dp:deliver_for(Index, Count);
            false -> ok
        end,
    {ok, {Index, Count}}.

%% @private
-spec handle_call(term(), gen_server:from(), S) -> {reply, {error, badarg}, S}.
handle_call(_Req, _From, S) ->
    {reply, {error, badarg}, S}.

%% @private
-spec handle_cast(term(), S) -> {noreply, S}.
handle_cast(_Msg, S) ->
    {noreply, S}.

%% @private
-spec handle_info(term(), S) -> {noreply, S}.
handle_info({actor_dp_drain, Seg, Ring}, S) ->
    ok = actor_dp:drain(Seg, Ring),
    {noreply, S};
handle_info(_Other, S) ->
    {noreply, S}.
