%% Helpers shared by the benchmarks (bench/run compiles them together): the
%% environment knobs, medians, waiting for peers to go, and the table of
%% rows beside their anchors with ratios and targets. Polling, OS-process
%% and epmd checks are support/ap_support.erl's (shared with the tests and
%% the demo; bench/run compiles it too).
-module(ap_bench_util).

-export([main/5]).
-export([env_int/2, median/1, wait_until/3, gone/3, stop_peers/1]).
-export([start_app/0, stop_app/1, node_name/1]).

-export([print/1, fmt/1, ratio/2]).

%% A bench's main: a watchdog that halts with 1 after TimeoutVar seconds
%% (default DefaultS), Run (returning the number of targets missed), then
%% every cleanup step whatever happened. Exits 0, 1 on a failure (a
%% {bench_failed, Fmt, Args} throw or any exception, reported), or 2 when a
%% target was missed and BENCH_STRICT=1.
-spec main(string(), string(), pos_integer(), fun(() -> non_neg_integer()),
           [{string(), fun(() -> ok)}]) -> no_return().
main(Name, TimeoutVar, DefaultS, Run, Cleanup) ->
    %% print/1 names the bench in the CSV rows (ap_bench_csv).
    put(ap_bench_name, Name),
    Timeout = env_int(TimeoutVar, DefaultS),
    _ = spawn(fun() ->
                      timer:sleep(Timeout * 1000),
                      io:format("~s bench failed: not done after ~p s (~s)~n", [Name, Timeout, TimeoutVar]),
                      halt(1)
              end),
    Result = step(Name, "", Run),
    Clean = lists:foldl(fun({What, F}, Acc) ->
                                case step(Name, " " ++ What, F) of
                                    {ok, ok} -> Acc;
                                    _ -> failed
                                end
                        end, ok, Cleanup),
    Strict = os:getenv("BENCH_STRICT") =:= "1",
    halt(case {Result, Clean} of
             {{ok, Missed}, ok} when Missed > 0, Strict -> 2;
             {{ok, _}, ok} -> 0;
             _ -> 1
         end).

step(Name, What, F) ->
    try F() of
        V -> {ok, V}
    catch
        throw:{bench_failed, Fmt, Args} ->
            io:format("~n~s bench failed~s: " ++ Fmt ++ "~n", [Name, What | Args]),
            failed;
        C:R:St ->
            io:format("~n~s bench failed~s: ~p:~p~n~p~n", [Name, What, C, R, St]),
            failed
    end.

%% An integer knob from the OS environment; Default when unset or empty.
-spec env_int(string(), D) -> integer() | D.
env_int(Name, Default) ->
    case os:getenv(Name) of
        false -> Default;
        "" -> Default;
        V -> list_to_integer(V)
    end.

%% The middle element (the upper one of an even count).
-spec median([number()]) -> number().
median(L) ->
    lists:nth((length(L) + 1) div 2, lists:sort(L)).

%% Poll F every 5 ms until it is true; after Ms, fail the bench (the
%% {bench_failed, Fmt, Args} throw every bench's main catches) naming What.
-spec wait_until(fun(() -> boolean()), non_neg_integer(), term()) -> ok.
wait_until(F, Ms, What) ->
    case ap_support:poll(F, fun(B) -> B end, Ms, 5) of
        {ok, true} -> ok;
        {timeout, false} -> throw({bench_failed, "timeout after ~p ms waiting for ~p", [Ms, What]})
    end.

%% Waits (at most Ms each) until the node names have left epmd and the OS
%% processes are gone (exited; a zombie not yet reaped counts as gone): a
%% bench leaves nothing of its peers behind.
-spec gone([string()], [non_neg_integer()], non_neg_integer()) -> ok.
gone(Names, OsPids, Ms) ->
    wait_until(fun() -> [N || N <- ap_support:epmd_names(), lists:member(N, Names)] =:= [] end, Ms,
               {names_left_epmd, Names}),
    wait_until(fun() -> [P || P <- OsPids, ap_support:os_pid_alive(P)] =:= [] end, Ms,
               {os_processes_gone, OsPids}).

%% Stops every peer this process recorded as `{peer, Peer} => #{names :=
%% Names, os_pids := OsPids}' in its dictionary (the BEAM's and its C nodes'
%% names and OS pids, and optionally `segments': the /dev/shm files of its
%% C nodes), then waits for them to go (gone/3, and the segments removed).
-spec stop_peers(non_neg_integer()) -> ok.
stop_peers(Ms) ->
    Peers = [{P, Info} || {{peer, P}, Info} <- get()],
    [begin
         _ = (catch peer:stop(P)),
         erase({peer, P})
     end || {P, _} <- Peers],
    ok = gone(lists:append([Ns || {_, #{names := Ns}} <- Peers]),
              lists:append([Ps || {_, #{os_pids := Ps}} <- Peers]), Ms),
    Segments = lists:append([maps:get(segments, I, []) || {_, I} <- Peers]),
    wait_until(fun() -> not lists:any(fun filelib:is_file/1, Segments) end, Ms,
               {segments_left_dev_shm, Segments}).

%% Rows: {Label, Value, [{AnchorLabel, AnchorValue}], Target}; Target is
%% none, {le, Base, Factor, Text} (Value =< Base * Factor), {ge, Base,
%% Factor, Text} (Value >= Base * Factor), {lt_abs, Max, Text} or {ge_abs,
%% Min, Text}. Prints the table; returns the targets missed.
-spec print([{string(), term(), [{string(), term()}], term()}]) -> non_neg_integer().
print(Rows) ->
    io:format("~-40s ~12s  ~-36s ~12s ~7s  ~s~n",
              ["measure", "actor_pool", "anchor", "anchor val", "ratio", "target"]),
    lists:foldl(fun({Label, V, Anchors, Target}, Missed) ->
                        {Verdict, M} = verdict(V, Target),
                        ap_bench_csv:row(get(ap_bench_name), Label, V, Anchors, target_text(Target),
                                         case {Target, M} of {none, _} -> none; {_, 0} -> met; _ -> missed end),
                        case Anchors of
                            [] ->
                                io:format("~-40s ~12s  ~-36s ~12s ~7s  ~s~n",
                                          [Label, fmt(V), "", "", "", Verdict]);
                            [{AL, AV} | Rest] ->
                                io:format("~-40s ~12s  ~-36s ~12s ~7s  ~s~n",
                                          [Label, fmt(V), AL, fmt(AV), ratio(V, AV), Verdict]),
                                [io:format("~-40s ~12s  ~-36s ~12s ~7s~n",
                                           ["", "", L2, fmt(V2), ratio(V, V2)]) || {L2, V2} <- Rest]
                        end,
                        Missed + M
                end, 0, Rows).

target_text(none) -> "";
target_text(T) -> element(tuple_size(T), T).

verdict(_V, none) -> {"", 0};
verdict(undefined, {_, _, Text}) -> met(false, Text);
verdict(V, {le, Base, Factor, Text}) -> met(V =< Base * Factor, Text);
verdict(V, {ge, Base, Factor, Text}) -> met(V >= Base * Factor, Text);
verdict(V, {lt_abs, Max, Text}) -> met(V < Max, Text);
verdict(V, {ge_abs, Min, Text}) -> met(V >= Min, Text).

met(true, Text) -> {Text ++ " met", 0};
met(false, Text) -> {Text ++ " MISSED", 1}.

-spec ratio(term(), term()) -> iolist().
ratio(V, A) when not is_number(V); not is_number(A) -> "-";
ratio(_V, A) when A == 0 -> "-";
ratio(V, A) -> io_lib:format("~.2f", [V / A]).

-spec fmt(term()) -> iolist().
fmt(undefined) -> "-";
fmt(V) when V >= 100000 -> io_lib:format("~.1fK", [V / 1000]);
fmt(V) when V >= 1000 -> integer_to_list(round(V));
fmt(V) -> io_lib:format("~.1f", [float(V)]).

%% Starts the actor_pool application in this node and records its C nodes
%% (names, OS pids) for stop_app/1; fails the bench if it does not start.
-spec start_app() -> ok.
start_app() ->
    case application:ensure_all_started(actor_pool) of
        {ok, _} -> ok;
        Err -> throw({bench_failed, "application:ensure_all_started(actor_pool): ~p", [Err]})
    end,
    put(app_started, true),
    Own = [actor_cnode:info(O) || O <- [actor_pool_node_owner, actor_receptionist_owner]],
    put(own_cnodes, #{names => [node_name(N) || #{node := N} <- Own],
                      os_pids => [P || #{os_pid := P} <- Own, is_integer(P)]}),
    ok.

%% Stops what start_app/0 started, if it did, and waits (at most Ms) until
%% its C nodes left epmd and exited.
-spec stop_app(non_neg_integer()) -> ok.
stop_app(Ms) ->
    case erase(app_started) of
        undefined -> ok;
        true ->
            case application:stop(actor_pool) of
                ok -> ok;
                Err -> throw({bench_failed, "application:stop(actor_pool): ~p", [Err]})
            end,
            #{names := Names, os_pids := OsPids} = erase(own_cnodes),
            gone(Names, OsPids, Ms)
    end.

%% The name part of a node name, as epmd lists it.
-spec node_name(node()) -> string().
node_name(Node) ->
    [Name, _Host] = string:split(atom_to_list(Node), "@"),
    Name.
