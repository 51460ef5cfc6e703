%% @doc JSON documents for the pool benchmark, and the validation the Erlang
%% anchors do.
%%
%% `docs/1' generates a deterministic mix of realistic documents of about
%% 2 KB each (an API-style order: nested objects and arrays, strings with
%% escapes, raw UTF-8 and surrogate pairs, integers, negative numbers,
%% floats with exponents, booleans and nulls, some pretty-printed, some
%% compact). `validate/1' is what a BEAM worker does with one: the document is
%% valid when `jiffy:decode/1' succeeds.
-module(ap_bench_json).

-export([docs/1, validate/1]).

-define(MIN_SIZE, 1950).
-define(MAX_SIZE, 2400).

-spec validate(binary()) -> ok | {error, term()}.
validate(Doc) ->
    try jiffy:decode(Doc) of
        _ -> ok
    catch
        error:{Pos, Reason} -> {error, {Pos, Reason}};
        error:Reason -> {error, Reason}
    end.

%% Count distinct documents, each ?MIN_SIZE..?MAX_SIZE bytes; the same
%% Count always gives the same documents.
-spec docs(pos_integer()) -> [binary()].
docs(Count) ->
    Old = rand:export_seed(),
    _ = rand:seed(exsss, {2026, 11, Count}),
    try
        [doc(I) || I <- lists:seq(1, Count)]
    after
        case Old of
            undefined -> ok;
            _ -> rand:seed(Old)
        end
    end.

doc(I) ->
    Pretty = I rem 3 =:= 0,
    doc(I, Pretty, 0).

%% Add line items until the document is in range; a document that overshoots
%% is regenerated with one item fewer.
doc(I, Pretty, Tries) ->
    Base = order(I),
    Doc = grow(Base, Pretty, []),
    Size = byte_size(Doc),
    if Size >= ?MIN_SIZE, Size =< ?MAX_SIZE -> Doc;
       Tries > 50 -> error({json_doc_size, I, Size});
       true -> doc(I, Pretty, Tries + 1)
    end.

grow(Base, Pretty, Items) ->
    Doc = iolist_to_binary(encode({obj, Base ++ [{<<"items">>, Items}]}, Pretty, 0)),
    case byte_size(Doc) of
        S when S < ?MIN_SIZE -> grow(Base, Pretty, Items ++ [item()]);
        _ -> Doc
    end.

order(I) ->
    [{<<"id">>, I},
     {<<"uuid">>, uuid()},
     {<<"created_at">>, timestamp()},
     {<<"status">>, pick([<<"new">>, <<"paid">>, <<"shipped">>, <<"cancelled">>])},
     {<<"priority">>, pick([null, 1, 2, 3])},
     {<<"customer">>,
      {obj, [{<<"name">>, name()},
             {<<"email">>, email()},
             {<<"verified">>, pick([true, false])},
             {<<"score">>, rand:uniform() * 100},
             {<<"tags">>, [word() || _ <- lists:seq(1, rand:uniform(4))]},
             {<<"address">>,
              {obj, [{<<"street">>, text(3)},
                     {<<"city">>, pick([<<"Zürich"/utf8>>, <<"São Paulo"/utf8>>,
                                        <<"東京"/utf8>>, <<"Kraków"/utf8>>, <<"Lyon">>])},
                     {<<"zip">>, integer_to_binary(10000 + rand:uniform(89999))},
                     {<<"geo">>, [rand:uniform() * 180 - 90, rand:uniform() * 360 - 180]}]}}]}},
     {<<"note">>, note()},
     {<<"discount">>, pick([null, 0, -5, 1.5e-3, 2.5e2])},
     {<<"meta">>, {obj, [{<<"source">>, pick([<<"web">>, <<"ios">>, <<"android">>])},
                         {<<"ab">>, {obj, [{word(), pick([true, false, null])}
                                           || _ <- lists:seq(1, 3)]}},
                         {<<"trace">>, [rand:uniform(1 bsl 40) || _ <- lists:seq(1, 3)]},
                         {<<"empty">>, {obj, []}},
                         {<<"none">>, []}]}}].

item() ->
    {obj, [{<<"sku">>, iolist_to_binary(io_lib:format("SKU-~6..0B", [rand:uniform(999999)]))},
           {<<"title">>, text(2 + rand:uniform(4))},
           {<<"qty">>, rand:uniform(20)},
           {<<"price">>, round(rand:uniform() * 100000) / 100},
           {<<"weight_kg">>, pick([0.25, 1.0e1, 3.75e-1, 12])},
           {<<"gift">>, pick([true, false])},
           {<<"options">>, {obj, [{<<"color">>, word()}, {<<"size">>, pick([<<"S">>, <<"M">>, <<"XL">>, null])}]}}]}.

%% ---- values ------------------------------------------------------------------

words() ->
    {<<"alpha">>, <<"bravo">>, <<"widget">>, <<"gadget">>, <<"blue">>, <<"steel">>,
     <<"organic">>, <<"express">>, <<"café"/utf8>>, <<"naïve"/utf8>>, <<"größe"/utf8>>,
     <<"señal"/utf8>>, <<"очень"/utf8>>, <<"日本"/utf8>>, <<"premium">>, <<"refurbished">>,
     <<"bundle">>, <<"limited">>, <<"edition">>, <<"classic">>}.

word() -> element(rand:uniform(tuple_size(words())), words()).

text(N) -> iolist_to_binary(lists:join(<<" ">>, [word() || _ <- lists:seq(1, N)])).

name() -> iolist_to_binary([pick([<<"Ada">>, <<"Grace">>, <<"José"/utf8>>, <<"Zoë"/utf8>>, <<"Linus">>]),
                            " ", pick([<<"Lovelace">>, <<"Hopper">>, <<"O'Neil">>, <<"Müller"/utf8>>])]).

email() -> iolist_to_binary([word(), ".", integer_to_list(rand:uniform(999)), "@example.com"]).

%% A string whose JSON form needs escapes: quotes, backslashes, control
%% characters, and an emoji (a surrogate pair when escaped, raw otherwise).
note() ->
    {raw_string, iolist_to_binary(
                   [text(4), " \\\"quoted\\\" C:\\\\path\\\\x\\n\\ttab ",
                    pick([<<"\\u00e9t\\u00e9">>, <<"\\ud83d\\ude00 smile">>, <<"😀 raw"/utf8>>]),
                    " ", text(3)])}.

uuid() ->
    <<A:32, B:16, C:16, D:16, E:48>> = rand:bytes(16),
    iolist_to_binary(io_lib:format("~8.16.0b-~4.16.0b-~4.16.0b-~4.16.0b-~12.16.0b", [A, B, C, D, E])).

timestamp() ->
    iolist_to_binary(io_lib:format("2026-~2..0B-~2..0BT~2..0B:~2..0B:~2..0BZ",
                                   [rand:uniform(12), rand:uniform(28), rand:uniform(24) - 1,
                                    rand:uniform(60) - 1, rand:uniform(60) - 1])).

pick(L) -> lists:nth(rand:uniform(length(L)), L).

%% ---- encoder -----------------------------------------------------------------

encode({obj, []}, _, _) -> "{}";
encode({obj, KVs}, Pretty, D) ->
    Items = [[nl(Pretty, D + 1), string(K), sep(Pretty), encode(V, Pretty, D + 1)] || {K, V} <- KVs],
    ["{", lists:join(",", Items), nl(Pretty, D), "}"];
encode([], _, _) -> "[]";
encode(L, Pretty, D) when is_list(L) ->
    ["[", lists:join(",", [[nl(Pretty, D + 1), encode(V, Pretty, D + 1)] || V <- L]), nl(Pretty, D), "]"];
encode({raw_string, S}, _, _) -> [$", S, $"];
encode(B, _, _) when is_binary(B) -> string(B);
encode(true, _, _) -> "true";
encode(false, _, _) -> "false";
encode(null, _, _) -> "null";
encode(I, _, _) when is_integer(I) -> integer_to_list(I);
encode(F, _, _) when is_float(F) -> float_to_list(F, [short]).

string(B) -> [$", [esc(C) || <<C/utf8>> <= B], $"].

esc($") -> "\\\"";
esc($\\) -> "\\\\";
esc($\n) -> "\\n";
esc(C) when C < 16#20 -> io_lib:format("\\u~4.16.0b", [C]);
esc(C) -> <<C/utf8>>.

nl(false, _) -> "";
nl(true, D) -> ["\n", lists:duplicate(D * 2, $\s)].

sep(false) -> ":";
sep(true) -> ": ".
