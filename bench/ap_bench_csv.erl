%% The benchmarks' rows as CSV, for `make bench-report' (bench/report draws
%% them with gnuplot). bench/run starts `_build/bench/results.csv' (its
%% header) and `results.meta' (when, where) before the benches run; each
%% bench appends a line per measure beside each of its anchors:
%%
%%   bench,io,measure,value,anchor,anchor_value,ratio,better,target,met
%%
%% `better' is `higher' for rates (a measure named per second) and `lower'
%% for the rest (times, CPU, bytes); `ratio' is value / anchor_value as
%% printed; `met' is `met', `missed' or empty when the row has no target.
%% The file is $BENCH_CSV (bench/run names partial.csv for a partial run),
%% results.csv by default. Without it (a bench run alone, not through
%% bench/run) nothing is written.
-module(ap_bench_csv).

-export([row/6]).

-define(CSV_FILE, os:getenv("BENCH_CSV", "_build/bench/results.csv")).

%% @doc Appends one line per anchor (one with empty anchor columns when
%% there is none) for measure Label of bench Bench.
-spec row(string(), string(), term(), [{string(), term()}], string(), met | missed | none) -> ok.
row(Bench, Label, Value, Anchors, Target, Met) ->
    case filelib:is_regular(?CSV_FILE) andalso is_number(Value) of
        true ->
            Io = os:getenv("ACTOR_POOL_IO", "auto"),
            Lines = case [{L, V} || {L, V} <- Anchors, is_number(V)] of
                        [] -> [line(Bench, Io, Label, Value, "", "", Target, Met)];
                        As -> [line(Bench, Io, Label, Value, L, V, Target, Met) || {L, V} <- As]
                    end,
            ok = file:write_file(?CSV_FILE, Lines, [append]);
        false ->
            ok
    end.

line(Bench, Io, Label, Value, AL, AV, Target, Met) ->
    Ratio = case is_number(AV) andalso AV /= 0 of
                true -> num(Value / AV);
                false -> ""
            end,
    lists:join($,, [csv(Bench), csv(Io), csv(string:trim(Label)), num(Value), csv(AL),
                    case AV of "" -> ""; _ -> num(AV) end, Ratio, better(Label),
                    csv(Target), case Met of none -> ""; _ -> atom_to_list(Met) end]) ++ "\n".

%% Rates are "per second" (msg/s, asks/s, docs/s, ...): higher is better.
better(Label) ->
    case re:run(Label, "/s\\)|per s(econd)?\\b", [caseless]) of
        {match, _} -> "higher";
        nomatch -> "lower"
    end.

num(V) when is_integer(V) -> integer_to_list(V);
num(V) when is_float(V) -> float_to_list(V, [{decimals, 4}, compact]).

%% RFC 4180: quoted when it holds a comma, a quote or a line break.
csv(S0) ->
    S = lists:flatten(io_lib:format("~ts", [S0])),
    case lists:any(fun(C) -> lists:member(C, ",\"\n") end, S) of
        true -> [$" | lists:flatmap(fun($") -> "\"\""; (C) -> [C] end, S)] ++ [$"];
        false -> S
    end.
