"""Planning: what a write will do, decided once, before any data is read.

    options --QuantizeRequest.from_options--> QuantizeRequest   (frozen: the selection, the
              container and layout asked for, one tagged calibration value)
            --plan_quantize--> Plan                              (a value: nothing changes it after)
                               + the calibration request, where there is one
    Plan --the executor (qtool.pipeline), with what calibration made beside it--> bytes

Here too: where an output may go (`paths`), what every calibrated run needs of its input
(`preconditions`), the `qtool imatrix` command (`imatrix_command`) and the `qtool schemes`
catalogue (`schemes`). The API (`qtool.api`) builds the request, calls this and runs the plan;
nothing below this layer decides what a write is.
"""
