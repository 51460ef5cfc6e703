%% The application environment is written down once: every key the code
%% reads is in the .app.src's `env' with the default the code falls back
%% to, and in the one table of docs/operations.md ("Application
%% environment") with that default, and no key is anywhere but in all
%% three. A key added to one and forgotten in another fails here.
%%
%% The I/O backend's names: the application key `io' (and `io_backend', its
%% old name) and actor_cnode's `io' option each decide over the OS variable
%% ACTOR_POOL_IO, which decides while they say `auto'; checked on real echo
%% C nodes. ACTOR_POOL_ECHO_EXE names another echo executable (an absolute
%% path) when set. Each C node started here is stopped.
-module(actor_pool_env_tests).

-import(ap_test_util, [alive/1, echo_exe/0]).
-import(ap_support, [wait_until/2, epmd_names/0, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

-define(WAIT_MS, 10000).

%% Old names the code still reads, with the key that replaced each.
-define(OLD_NAMES, #{io_backend => io}).

%% ===================================================================
%% One place for every key
%% ===================================================================

app_src_env_is_the_docs_table_test() ->
    Env = app_src_env(),
    Rows = docs_table(),
    Keys = [K || {K, _, _} <- Rows],
    ?assertEqual([], Keys -- lists:usort(Keys)),
    ?assertEqual(lists:sort(proplists:get_keys(Env)), lists:sort(Keys)),
    %% The table's default is the .app.src's, read as a term.
    [?assertEqual({Key, proplists:get_value(Key, Env)}, {Key, Default})
     || {Key, Default, _} <- Rows],
    %% An old name is said in its new key's row, and is no key of its own.
    [begin
         {New, _, Text} = lists:keyfind(New, 1, Rows),
         ?assertNotEqual(nomatch, string:find(Text, "`" ++ atom_to_list(Old) ++ "`")),
         ?assertNot(proplists:is_defined(Old, Env))
     end || {Old, New} <- maps:to_list(?OLD_NAMES)].

code_reads_the_keys_of_the_app_src_test() ->
    Env = app_src_env(),
    Reads = env_reads(),
    %% Every key read is listed (or an old name), every listed key read.
    ?assertEqual(lists:sort(proplists:get_keys(Env) ++ maps:keys(?OLD_NAMES)),
                 lists:usort([K || {K, _, _} <- Reads])),
    %% The default the code falls back to (when the application is not
    %% loaded) is the .app.src's.
    [?assertEqual({Key, M, proplists:get_value(maps:get(Key, ?OLD_NAMES, Key), Env)},
                  {Key, M, Default})
     || {Key, {default, Default}, M} <- Reads].

%% The README lists the common keys: none that is not one.
readme_names_only_keys_of_the_app_src_test() ->
    Env = app_src_env(),
    Keys = table_keys(section(readme(), "## Configuration")),
    ?assertNotEqual([], Keys),
    ?assertEqual([], Keys -- proplists:get_keys(Env)).

%% The OS variables the code reads are in docs/operations.md's list.
os_variables_are_documented_test() ->
    Section = section(operations_md(), "## Environment variables"),
    Vars = lists:usort([V || {_, Forms} <- forms(), {os_getenv, V} <- calls(Forms)]),
    ?assertNotEqual([], Vars),
    ?assertEqual([], [V || V <- Vars, string:find(Section, "`" ++ V ++ "`") =:= nomatch]).

%% ===================================================================
%% The I/O backend's names, on real C nodes
%% ===================================================================

io_names_test_() ->
    {setup, fun ap_test_util:start_app/0, fun ap_test_util:stop_app/1,
     fun(_) ->
             [{timeout, 60, {Name, Case}}
              || {Name, Case} <- [{"app key io and its old name decide over the OS variable",
                                   fun app_key_io_and_its_old_name_decide_over_the_os_variable/0},
                                  {"bad io values are badarg", fun bad_io_values_are_badarg/0}]]
     end}.

%% With ACTOR_POOL_IO=uring, a node asked for nothing gets what a request
%% for uring gets on this host (io_uring when the kernel lets us); `io' or
%% `io_backend' set to epoll gives epoll, `io' before `io_backend'.
app_key_io_and_its_old_name_decide_over_the_os_variable() ->
    with_os_io("uring", fun() ->
        Uring = started_io(#{}),
        ?assert(lists:member(Uring, [uring, epoll])),
        ?assertEqual(epoll, with_env([{io, epoll}], fun() -> started_io(#{}) end)),
        ?assertEqual(epoll, with_env([{io_backend, epoll}], fun() -> started_io(#{}) end)),
        ?assertEqual(epoll, with_env([{io, auto}, {io_backend, epoll}], fun() -> started_io(#{}) end)),
        ?assertEqual(Uring, with_env([{io, uring}, {io_backend, epoll}], fun() -> started_io(#{}) end))
    end),
    %% And the other way round: the OS variable says epoll, the key uring.
    with_os_io("epoll", fun() ->
        ?assertEqual(epoll, started_io(#{})),
        Uring = with_env([{io, uring}], fun() -> started_io(#{}) end),
        ?assertEqual(Uring, with_env([{io_backend, uring}], fun() -> started_io(#{}) end)),
        %% actor_cnode's io option decides over both keys.
        ?assertEqual(epoll, with_env([{io, uring}], fun() -> started_io(#{io => epoll}) end))
    end).

bad_io_values_are_badarg() ->
    [begin
         R = with_env([{Key, bogus}], fun() -> actor_cnode:start(#{exe => echo_exe()}) end),
         _ = [actor_cnode:stop(P) || {ok, P} <- [R]],
         ?assertEqual({Key, {error, {badarg, {io, bogus}}}}, {Key, R})
     end || Key <- [io, io_backend]].

%% The backend of an echo node started with Opts (and the application's
%% environment for the rest); the node is stopped before this returns.
started_io(Opts) ->
    Name = alive("envio"),
    {ok, Owner} = actor_cnode:start(Opts#{exe => echo_exe(), name => Name}),
    #{io := Io, os_pid := OsPid, status := up} = actor_cnode:info(Owner),
    ok = actor_cnode:stop(Owner),
    wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
    wait_until(fun() -> not lists:member(Name, epmd_names()) end, ?WAIT_MS),
    Io.

with_os_io(Value, Fun) ->
    Saved = os:getenv("ACTOR_POOL_IO"),
    true = os:putenv("ACTOR_POOL_IO", Value),
    try
        Fun()
    after
        case Saved of
            false -> os:unsetenv("ACTOR_POOL_IO");
            _ -> os:putenv("ACTOR_POOL_IO", Saved)
        end
    end.

with_env([], Fun) ->
    Fun();
with_env([{Key, Value} | Rest], Fun) ->
    ap_test_util:with_env(actor_pool, Key, Value, fun() -> with_env(Rest, Fun) end).

%% ===================================================================
%% Reading the three places
%% ===================================================================

app_src_env() ->
    {ok, [{application, actor_pool, Props}]} =
        file:consult(filename:join([ap_support:root(), "src", "actor_pool.app.src"])),
    {env, Env} = lists:keyfind(env, 1, Props),
    Env.

operations_md() ->
    read(filename:join([ap_support:root(), "docs", "operations.md"])).

readme() ->
    read(filename:join(ap_support:root(), "README.md")).

read(File) ->
    {ok, Bin} = file:read_file(File),
    unicode:characters_to_list(Bin).

%% The lines after Heading up to the next heading of its level or above
%% (a `#' inside a fenced block is no heading).
section(Text, Heading) ->
    Lines = string:split(Text, "\n", all),
    case lists:dropwhile(fun(L) -> L =/= Heading end, Lines) of
        [_ | After] -> lists:flatten(lists:join("\n", body(After, level(Heading), false)));
        [] -> error({no_section, Heading})
    end.

body([], _, _) ->
    [];
body(["```" ++ _ = L | Rest], Level, Fenced) ->
    [L | body(Rest, Level, not Fenced)];
body([L | Rest], Level, false) ->
    case level(L) of
        N when N > 0, N =< Level -> [];
        _ -> [L | body(Rest, Level, false)]
    end;
body([L | Rest], Level, true) ->
    [L | body(Rest, Level, true)].

level(Line) ->
    case lists:splitwith(fun(C) -> C =:= $# end, Line) of
        {Hashes, " " ++ _} -> length(Hashes);
        _ -> 0
    end.

%% docs/operations.md's table: {Key, Default, RowText} per row.
docs_table() ->
    Section = section(operations_md(), "### Application environment"),
    Rows = [L || L <- string:split(Section, "\n", all), lists:prefix("| `", L)],
    ?assertNotEqual([], Rows),
    [begin
         [Key, Default | _] = cells(Row),
         {list_to_atom(unquote(Key)), term(unquote(Default)), Row}
     end || Row <- Rows].

table_keys(Section) ->
    [list_to_atom(K) || L <- string:split(Section, "\n", all), lists:prefix("| `", L),
                        {match, Ks} <- [re:run(hd(cells(L)), "`([a-z_]+)`",
                                               [global, {capture, all_but_first, list}])],
                        [K] <- Ks].

%% A table row's cells, trimmed; an escaped pipe (\|) is no separator.
cells(Line) ->
    Inner = string:trim(string:trim(Line), both, "|"),
    [string:trim(C) || C <- re:split(Inner, "(?<!\\\\)\\|", [{return, list}, unicode])].

unquote("`" ++ Rest) ->
    case lists:reverse(Rest) of
        "`" ++ R -> lists:reverse(R);
        _ -> error({not_one_code_span, Rest})
    end;
unquote(Cell) ->
    error({not_one_code_span, Cell}).

term(Text) ->
    {ok, Tokens, _} = erl_scan:string(Text ++ "."),
    {ok, Term} = erl_parse:parse_term(Tokens),
    Term.

%% ===================================================================
%% What the code reads
%% ===================================================================

%% The application's modules, as compiled (debug_info).
forms() ->
    ok = case application:load(actor_pool) of
             ok -> ok;
             {error, {already_loaded, actor_pool}} -> ok
         end,
    {ok, Mods} = application:get_key(actor_pool, modules),
    ?assertNotEqual([], Mods),
    [begin
         {ok, {M, [{abstract_code, {raw_abstract_v1, Forms}}]}} =
             beam_lib:chunks(code:which(M), [abstract_code]),
         {M, Forms}
     end || M <- Mods].

%% {Key, {default, Term} | none, Module} for every read of an actor_pool
%% key: a call of application:get_env with a literal key, or through a
%% wrapper (a fun bound to a variable, or a local function) whose key and
%% default are its parameters, with literal arguments at each call.
env_reads() ->
    lists:append([reads(M, Forms) || {M, Forms} <- forms()]).

reads(M, Forms) ->
    Calls = calls(Forms),
    Direct = [{K, D, M} || {get_env, {atom, _, K}, D} <- Calls],
    Wrapped = lists:append([wrapped(M, F, Forms) || {function, _, _, _, _} = F <- Forms]),
    %% A read whose key is neither literal nor a wrapper's parameter cannot
    %% be checked: read keys by name.
    Resolved = [L || {resolved, L} <- Wrapped],
    Unresolved = [{line, line(Key)} || {get_env, Key, _} <- Calls, element(1, Key) =/= atom,
                               not lists:member({line, line(Key)}, Resolved)],
    ?assertEqual({M, unresolved_keys_at_lines, []}, {M, unresolved_keys_at_lines, Unresolved}),
    Direct ++ [R || {read, R} <- Wrapped].

%% Wrappers in function F: funs bound to a variable (used within F) and F
%% itself (used anywhere in the module).
wrapped(M, {function, _, Name, Arity, Clauses} = F, Forms) ->
    Funs = [{{var, V}, Params, Body}
            || {match, _, {var, _, V}, {'fun', _, {clauses, [{clause, _, Params, [], Body}]}}}
                   <- subterms(F)],
    Own = [{{local, Name, Arity}, Params, Body} || {clause, _, Params, [], Body} <- Clauses],
    lists:append([wrapper_reads(M, W, Params, Body, F, Forms) || {W, Params, Body} <- Funs ++ Own]).

wrapper_reads(M, W, Params, Body, F, Forms) ->
    Names = [P || {var, _, P} <- Params],
    Inner = [{KeyVar, Default, line(Key)}
             || {get_env, {var, _, KeyVar} = Key, Default} <- calls(Body),
                lists:member(KeyVar, Names)],
    Scope = case W of {var, _} -> [F]; {local, _, _} -> Forms end,
    Uses = [Args || S <- Scope, {call, _, Callee, Args} <- subterms(S), callee(Callee, W, length(Params))],
    %% A wrapper passed on is called where this cannot follow it.
    _ = [error({M, W, key_reader_passed_on}) || Inner =/= [], passed_on(W, Scope, length(Uses))],
    lists:append(
      [[{resolved, {line, Line}}
        | [{read, {key(M, lists:nth(pos(KeyVar, Names), Args)), arg_default(Default, Names, Args), M}}
           || Args <- Uses]]
       || {KeyVar, Default, Line} <- Inner]).

key(_, {atom, _, K}) -> K;
key(M, Expr) -> error({M, key_is_no_literal_at_line, line(Expr)}).

%% A fun bound to a variable occurs once bound and once per call; a local
%% function is referred to by calls only.
passed_on({var, V}, [F], Calls) ->
    length([x || {var, _, V1} <- subterms(F), V1 =:= V]) > 1 + Calls;
passed_on({local, Name, Arity}, Forms, _) ->
    [] =/= [x || {'fun', _, {function, N, A}} <- subterms(Forms), N =:= Name, A =:= Arity].

callee({var, _, V}, {var, V}, _) -> true;
callee({atom, _, Name}, {local, Name, Arity}, N) -> N =:= Arity;
callee(_, _, _) -> false.

arg_default({default, {var, _, V}} = Default, Names, Args) ->
    case lists:member(V, Names) of
        true -> literal(lists:nth(pos(V, Names), Args));
        false -> Default
    end;
arg_default(Default, _, _) ->
    Default.

pos(X, List) ->
    length(lists:takewhile(fun(Y) -> Y =/= X end, List)) + 1.

%% Reads of actor_pool keys and OS variables among the calls in Form.
calls(Form) ->
    lists:filtermap(fun call/1, subterms(Form)).

call({call, _, {remote, _, {atom, _, application}, {atom, _, get_env}},
      [{atom, _, actor_pool}, Key | Default]}) ->
    {true, {get_env, Key, case Default of [D] -> literal(D); [] -> none end}};
call({call, _, {remote, _, {atom, _, application}, {atom, _, get_env}}, [_]} = C) ->
    %% The caller's application: say actor_pool.
    error({reads_an_unnamed_application_at_line, line(C)});
call({call, _, {remote, _, {atom, _, application}, {atom, _, get_all_env}}, _} = C) ->
    error({reads_every_key_at_line, line(C)});
call({call, _, {remote, _, {atom, _, os}, {atom, _, getenv}}, [{string, _, Var} | _]}) ->
    {true, {os_getenv, Var}};
call(_) ->
    false.

%% A default that is a term written out, or a parameter (resolved at the
%% wrapper's call).
literal({var, _, _} = V) ->
    {default, V};
literal(Expr) ->
    try erl_parse:normalise(Expr) of
        T -> {default, T}
    catch
        _:_ -> error({default_is_no_literal_at_line, line(Expr)})
    end.

line(Form) ->
    erl_anno:line(element(2, Form)).

%% Every tuple inside Term, Term included.
subterms(Term) ->
    lists:reverse(subterms(Term, [])).

subterms(T, Acc) when is_tuple(T) ->
    lists:foldl(fun subterms/2, [T | Acc], tuple_to_list(T));
subterms(L, Acc) when is_list(L) ->
    lists:foldl(fun subterms/2, Acc, L);
subterms(_, Acc) ->
    Acc.
