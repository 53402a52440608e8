# STAGED_FORWARD_INPUT on against off (jaxengine/model_runner.py) on the SmolLM2 shape, one H100,
# fresh processes alternating: the suite's idle figure (smol_idle.py) twice each, then one
# step_trace each for the forward's launch time. Run from the checkout after the wheel line.
O=$OUT/staged; mkdir -p $O
idle(){ timeout 200 python -c "import sys,runpy,jaxengine.model_runner as m; m.STAGED_FORWARD_INPUT=$2; sys.argv=['smol_idle','--label','$1','--out','$O']; runpy.run_path('lab/gpu_checks/smol_idle.py',run_name='__main__')" 2>&1 | grep "^\[$1\]"; }
for i in 1 2; do idle on_$i True; idle off_$i False; done
for v in true false; do timeout 240 python lab/gpu_checks/step_trace.py --model smol --patch model_runner.STAGED_FORWARD_INPUT=$v --tag _$v --out $O 2>&1 | grep -E "untraced|launch|window|je:fwd" | head -6; done
rm -f $O/*.gz
